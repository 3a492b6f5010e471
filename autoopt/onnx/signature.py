"""What an exported ONNX file takes and returns, settled before any export work.

``export_onnx`` checks its arguments here (``path``, ``dynamic=``, the options an
``OptimizedModule`` cannot honour), so that a bad one fails in a second rather than after
optimizing. The file's input names (the forward's argument names), output names (from the
output's structure) and the dimensions left symbolic are derived here too, the same way for
both exporters and for the verification that feeds the file by name.
"""

from __future__ import annotations

import inspect
import re
from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch.utils import _pytree as pytree

from autoopt.capture.graph import dynamic_shapes_for
from autoopt.check.inputs import leaves
from autoopt.errors import ConfigError, InputError

# The dimensions ``dynamic=`` can name, and which input dimension each one is:
#   "batch"     dim 0 of every tensor input with at least one dimension;
#   "sequence"  dim 1 of every integer or bool tensor input with at least two (token ids,
#               attention masks). Float inputs are left alone: dim 1 of an image is channels.
DYNAMIC_DIMS = ("batch", "sequence")


def check_path(path: str | Path) -> Path:
    """``path`` as a ``Path``; a directory, a missing folder or an unwritable file is a
    ``ConfigError`` now."""
    path = Path(path)
    if path.is_dir():
        raise ConfigError(f"path {str(path)!r} is a directory; give a file name such as "
                          f"{str(path / 'model.onnx')!r}")
    if not path.parent.is_dir():
        raise ConfigError(f"cannot write {str(path)!r}: directory {str(path.parent)!r} does "
                          "not exist")
    check_writable(path, f"path {str(path)!r}")
    return path


def check_writable(path: Path, what: str) -> None:
    """Raise ``ConfigError`` now if ``path`` cannot be written, rather than after the work.

    Opening is the only reliable test (``os.access`` says yes to root in ``/proc``); append mode
    leaves an existing file as it is, and a file made by the test is removed again.
    """
    existed = path.exists()
    try:
        with open(path, "ab"):
            pass
    except OSError as exc:
        raise ConfigError(f"{what}: cannot write there ({exc.strerror or exc}); choose a "
                          f"writable path.") from exc
    if not existed:
        path.unlink(missing_ok=True)


def check_dynamic(dynamic: str | Sequence[str] | None) -> tuple[str, ...]:
    """``dynamic=`` as a tuple of names from ``DYNAMIC_DIMS`` (None: none)."""
    if dynamic is None:
        return ()
    if not isinstance(dynamic, (str, list, tuple, set, frozenset)):
        raise ConfigError(f"dynamic={dynamic!r}: give a dimension name or a list of them, "
                          f"from {DYNAMIC_DIMS}")
    dims = (dynamic,) if isinstance(dynamic, str) else tuple(dynamic)
    unknown = [d for d in dims if d not in DYNAMIC_DIMS]
    if unknown:
        raise ConfigError(f"dynamic={dims}: unknown dimension(s) {unknown}; use a subset of "
                          f"{DYNAMIC_DIMS}")
    return dims


def check_dims_apply(dims: tuple[str, ...], args: tuple[Any, ...],
                     kwargs: Mapping[str, Any]) -> None:
    """Each dimension ``dynamic=`` names must exist on some input; else the file would be
    static while the report says it is dynamic."""
    tensors = [x for x in pytree.tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)]
    for dim in dims:
        if not any(dim in dims_of(t, (dim,)).values() for t in tensors):
            rule = ("dim 0 of a tensor input" if dim == "batch" else
                    "dim 1 of an integer or bool input with at least two dimensions "
                    "(token ids, masks)")
            shapes = ", ".join(f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)}"
                               for t in tensors) or "none"
            raise ConfigError(f"dynamic={dim!r} means {rule}, and no example input has one "
                              f"(tensor inputs: {shapes}); leave {dim!r} out.")


def check_optimized(optimized: Any, dims: tuple[str, ...], precision: str | None,
                    config: Any) -> None:
    """An ``OptimizedModule`` is exported as it was built: refuse options it cannot honour."""
    if dims and not optimized.is_dynamic:
        raise ConfigError(f"dynamic={dims} but this OptimizedModule was built for static "
                          "shapes; pass the nn.Module itself, or optimize it with "
                          "dynamic=True.")
    built = optimized.config.precision
    if precision is not None and precision != (built or "fp32"):
        raise ConfigError(f"precision={precision!r}, but this OptimizedModule was optimized "
                          f"with precision={built!r} and is exported as it is; pass the "
                          f"nn.Module itself, or optimize it with precision={precision!r}.")
    if config is not None:
        raise ConfigError("config= sets how export_onnx optimizes a plain nn.Module; this "
                          "OptimizedModule is exported as it was built. Pass the nn.Module "
                          "itself, or optimize it with that config.")


def in_forward_order(forward: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
    """``kwargs`` in ``forward``'s parameter order (names it does not list last, as given).

    The exporters order ONNX inputs as the keywords were given, and the session takes
    positional inputs in the file's order: this makes that order the model's own.
    """
    try:
        order = list(inspect.signature(forward).parameters)
    except (TypeError, ValueError):
        return kwargs
    rank = {name: i for i, name in enumerate(order)}
    return dict(sorted(kwargs.items(), key=lambda kv: rank.get(kv[0], len(order))))


def dims_of(value: torch.Tensor, dims: tuple[str, ...]) -> dict[int, str]:
    """The input dimensions ``dims`` name on this tensor (see ``DYNAMIC_DIMS``)."""
    out = {}
    if "batch" in dims and value.dim() >= 1:
        out[0] = "batch"
    if "sequence" in dims and value.dim() >= 2 and not (value.is_floating_point()
                                                         or value.is_complex()):
        out[1] = "sequence"
    return out


def dynamic_shapes(forward: Any, args: tuple[Any, ...], kwargs: Mapping[str, Any],
                   dims: tuple[str, ...], named: bool = False) -> dict[str, Any] | None:
    """``dynamic_shapes`` keyed by the forward's argument names.

    ``Dim.DYNAMIC`` lets ``torch.export`` infer each dimension's range (BERT's sequence is
    at most its position table) and fail if the model fixes it; ``named=True`` gives the
    names instead, which ``torch.onnx.export`` reads the same way and writes into the file.
    """
    if not dims:
        return None
    symbols = {name: name if named else torch.export.Dim.DYNAMIC for name in dims}

    def tensor_dims(value: torch.Tensor) -> dict[int, Any] | None:
        found = dims_of(value, dims)
        small = [(d, value.shape[d]) for d in found if value.shape[d] < 2]
        if small:
            raise InputError(f"dynamic {found[small[0][0]]!r} is dimension {small[0][0]} "
                             f"of an example input of shape {tuple(value.shape)}, whose "
                             f"size {small[0][1]} export would fix; use an example with "
                             f"a size of at least 2 there.")
        return {d: symbols[name] for d, name in found.items()} or None

    return dynamic_shapes_for(forward, args, kwargs, tensor_dims)


def flat_tensors(args: tuple[Any, ...], kwargs: Mapping[str, Any],
                 names: Sequence[str]) -> dict[str, torch.Tensor]:
    """The tensors of ``(args, kwargs)`` by input name, in the order ``name_inputs`` names them."""
    tensors = [x for x in pytree.tree_leaves((tuple(args), dict(kwargs)))
               if isinstance(x, torch.Tensor)]
    return dict(zip(names, tensors, strict=True))


def name_inputs(forward: Any, args: tuple[Any, ...], kwargs: Mapping[str, Any],
                ) -> list[str]:
    """One name per tensor input, in pytree order of ``(args, kwargs)`` (the order the
    exporters give the inputs): the forward's argument name, with ``_0``, ``_key`` suffixes
    inside lists and dicts."""
    try:
        parameters = list(inspect.signature(forward).parameters.values())
    except (TypeError, ValueError):
        parameters = []
    positional = [p.name for p in parameters
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    star = next((p.name for p in parameters if p.kind is p.VAR_POSITIONAL), None)
    extra = next((p.name for p in parameters if p.kind is p.VAR_KEYWORD), None)
    bound: list[tuple[str, Any]] = []
    for i, value in enumerate(args):
        bound.append((positional[i] if i < len(positional) else
                      f"{star}_{i - len(positional)}" if star else f"input_{i}", value))
    for key, value in kwargs.items():
        known = key in positional or any(p.name == key and p.kind is p.KEYWORD_ONLY
                                         for p in parameters)
        bound.append((key if known or not extra else f"{extra}_{key}", value))
    names = []
    for name, value in bound:
        flat, _ = pytree.tree_flatten_with_path(value)
        for key_path, leaf in flat:
            if isinstance(leaf, torch.Tensor):
                suffix = "".join(f"_{_key_text(k)}" for k in key_path)
                names.append(_identifier(name + suffix))
    return _unique(names)


def _key_text(key: Any) -> str:
    for attr in ("key", "idx", "name"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def name_outputs(expected: Any) -> list[str]:
    """``output['logits']`` -> ``logits``, ``output[0]`` -> ``output_0``, for tensor leaves."""
    names = []
    for where, leaf in leaves(expected, "output"):
        if not isinstance(leaf, torch.Tensor):
            continue
        parts = re.findall(r"\[['\"]?([^'\"\]]+)['\"]?\]|\.(\w+)", where[len("output"):])
        text = "_".join(a or b for a, b in parts)
        names.append(_identifier(text if text and not text[0].isdigit() else
                                 f"output_{text}".rstrip("_")))
    return _unique(names)


def _identifier(text: str) -> str:
    return re.sub(r"\W", "_", text)


def _unique(names: list[str]) -> list[str]:
    seen: Counter[str] = Counter()
    out = []
    for name in names:
        seen[name] += 1
        out.append(name if seen[name] == 1 else f"{name}_{seen[name] - 1}")
    return out
