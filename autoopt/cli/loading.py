"""Resolve command-line MODEL specs and input specs into modules and tensors."""

from __future__ import annotations

import difflib
import importlib
import importlib.util
import re
import sys
import types
from pathlib import Path
from typing import Any

import torch
from torch import nn

from autoopt.errors import ModelSpecError

_DTYPES = {"float32": torch.float32, "float": torch.float32, "fp32": torch.float32,
           "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
           "bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float64": torch.float64,
           "int64": torch.int64, "long": torch.int64, "int32": torch.int32, "bool": torch.bool}


def load_model(spec: str) -> nn.Module:
    """``package.module:factory``, ``path/to/file.py:Name`` or ``model.pt2`` → an nn.Module.

    A factory or class is called with no arguments; a module instance is used as it is.
    """
    if spec.endswith(".pt2"):
        from autoopt.capture.program import load_program

        return load_program(Path(spec), f"MODEL {spec!r}")
    if ":" not in spec:
        raise ModelSpecError(f"MODEL {spec!r} must be 'package.module:factory', "
                             "'path/to/file.py:Name' or a .pt2 file")
    target, name = _attribute(spec, "MODEL"), spec.rsplit(":", 1)[1]
    if isinstance(target, nn.Module):
        return target
    if not callable(target):
        raise ModelSpecError(f"MODEL {spec!r}: {name!r} is neither a module nor callable")
    try:
        model = target()
    except Exception as exc:
        raise ModelSpecError(f"MODEL {spec!r}: calling {name}() raised {type(exc).__name__}: "
                             f"{exc}") from exc
    if not isinstance(model, nn.Module):
        raise ModelSpecError(f"MODEL {spec!r}: {name}() returned {type(model).__name__}, "
                             "not an nn.Module")
    return model


def load_calibration(spec: str) -> Any:
    """``--calibration``: a folder of ``.pt`` files (one batch each, in name order: a tensor,
    a tuple of the model's inputs or a keyword dict), one ``.pt`` file holding a list of
    batches, or ``file.py:loader`` / ``package.module:loader`` (an iterable of batches, such
    as a DataLoader, or a function returning one)."""
    path = Path(spec)
    if path.is_dir():
        files = sorted(path.glob("*.pt"))
        if not files:
            raise ModelSpecError(f"--calibration {spec!r}: the folder holds no .pt file; save "
                                 f"one batch per file with torch.save")
        return [_load_tensors(f) for f in files]
    if path.suffix == ".pt":
        if not path.is_file():
            raise ModelSpecError(f"--calibration {spec!r}: no such file")
        batches = _load_tensors(path)
        if not isinstance(batches, (list, tuple)):
            raise ModelSpecError(f"--calibration {spec!r} holds a {type(batches).__name__}; a "
                                 f".pt file given alone holds a list of batches (a folder "
                                 f"holds one batch per file)")
        return list(batches)
    if ":" not in spec:
        raise ModelSpecError(f"--calibration {spec!r} is not a folder of .pt files, a .pt file "
                             f"or 'file.py:loader'")
    target = _attribute(spec, "--calibration")
    if callable(target) and not hasattr(target, "__iter__"):
        target = target()
    return target


def _load_tensors(path: Path) -> Any:
    try:
        return torch.load(path, weights_only=True)
    except Exception as exc:  # noqa: BLE001 - the user's file: say which and why
        raise ModelSpecError(f"--calibration: cannot read {str(path)!r} as tensors saved by "
                             f"torch.save: {type(exc).__name__}: {exc}") from exc


def _attribute(spec: str, label: str) -> Any:
    """What ``package.module:name`` or ``path/to/file.py:name`` names (``label`` is the
    argument, for the errors)."""
    where, name = spec.rsplit(":", 1)
    if not where or not name:
        missing = "module or file" if not where else "name after the colon"
        raise ModelSpecError(f"{label} {spec!r} has no {missing}; write "
                             "'package.module:factory' or 'path/to/file.py:Name'")
    if where.endswith(".py"):
        path = Path(where)
        if not path.is_file():
            raise ModelSpecError(f"{label} {spec!r}: no such file {where!r}")
        module_name = "_autoopt_user_" + re.sub(r"\W", "_", path.stem)
        loader = importlib.util.spec_from_file_location(module_name, path)
        if loader is None or loader.loader is None:
            raise ModelSpecError(f"{label} {spec!r}: cannot load {where!r} as Python")
        source = importlib.util.module_from_spec(loader)
        sys.modules[module_name] = source
        try:
            loader.loader.exec_module(source)
        except Exception as exc:
            raise ModelSpecError(f"{label} {spec!r}: running {where!r} raised "
                                 f"{type(exc).__name__}: {exc}") from exc
    else:
        try:
            source = importlib.import_module(where)
        except ImportError as exc:
            raise ModelSpecError(f"{label} {spec!r}: cannot import {where!r} ({exc})") from exc
        except Exception as exc:  # noqa: BLE001 - the user's module failed; say where
            raise ModelSpecError(f"{label} {spec!r}: importing {where!r} raised "
                                 f"{type(exc).__name__}: {exc}; fix the module (or run it with "
                                 f"python to see the traceback)") from exc
    target = getattr(source, name, None)
    if target is None:
        close = _close_names(source, name)
        raise ModelSpecError(f"{label} {spec!r}: {where!r} has no attribute {name!r}"
                             + (f"; did you mean {_either(close)}?" if close else ""))
    return target


def _close_names(source: Any, name: str) -> list[str]:
    """Names in ``source`` close to ``name`` (a typo's), of what MODEL can name: a class, a
    factory or a module instance, not a submodule (``torchvision.models.resnet``)."""
    public = [n for n in dir(source) if not n.startswith("_")]
    close = difflib.get_close_matches(name, public, n=6)
    return [n for n in close if isinstance(value := getattr(source, n, None), nn.Module)
            or (callable(value) and not isinstance(value, types.ModuleType))][:3]


def _either(names: list[str]) -> str:
    quoted = [repr(n) for n in names]
    return quoted[0] if len(quoted) == 1 else f"{', '.join(quoted[:-1])} or {quoted[-1]}"


def parse_input(text: str, default_dtype: str = "float32", int_high: int = 100,
                ) -> tuple[str | None, torch.Tensor]:
    """``[NAME=]1x3x224x224[:dtype]`` → (name or None, a random tensor of that shape).

    Floating inputs are standard normal; integer inputs uniform in ``[0, int_high)``.
    """
    name = None
    body = text
    if "=" in body:
        name, body = body.split("=", 1)
        if not name.isidentifier():
            raise ModelSpecError(f"--input {text!r}: {name!r} is not an argument name")
    dtype_name = default_dtype
    if ":" in body:
        body, dtype_name = body.split(":", 1)
    if not re.fullmatch(r"\d+(x\d+)*", body):
        raise ModelSpecError(f"--input {text!r}: shape must look like 1x3x224x224")
    if dtype_name not in _DTYPES:
        raise ModelSpecError(f"--input {text!r}: unknown dtype {dtype_name!r}; use one of "
                             f"{sorted(_DTYPES)}")
    shape = tuple(int(d) for d in body.split("x"))
    dtype = _DTYPES[dtype_name]
    if dtype.is_floating_point:
        return name, torch.randn(shape, dtype=dtype)
    if dtype == torch.bool:
        return name, torch.ones(shape, dtype=torch.bool)
    if int_high < 1:
        raise ModelSpecError(f"--input {text!r}: integer inputs are drawn from [0, INT_HIGH), "
                             f"which is empty for --int-high {int_high}; give --int-high 1 or "
                             f"more (the vocabulary size for token ids)")
    return name, torch.randint(0, int_high, shape, dtype=dtype)


def check_unique_names(specs: list[str]) -> None:
    """Refuse an input named twice: one would silently replace the other."""
    seen: dict[str, str] = {}
    for spec in specs:
        name = spec.split("=", 1)[0] if "=" in spec else None
        if name is not None and name in seen:
            raise ModelSpecError(f"--input {spec!r} names {name!r} again (after "
                                 f"{seen[name]!r}); give each input once")
        if name is not None:
            seen[name] = spec


def widened_for_dynamic(specs: list[str], dims: tuple[str, ...], default_dtype: str,
                        ) -> tuple[list[str], list[str]]:
    """``--input`` specs with each size of 1 that ``--dynamic`` makes symbolic drawn as 2, and
    a note per change.

    torch.export fixes a dimension whose example size is 0 or 1, so ``--input
    input_ids=1x128:int64 --dynamic batch`` could not keep the batch symbolic. The inputs are
    random, so an example batch of 2 costs nothing and the graph then takes any batch, 1
    included. ``dims`` are ``batch`` (dim 0) and ``sequence`` (dim 1 of an integer or bool
    input with two or more dimensions), the rule of ``--dynamic``.
    """
    out, notes = [], []
    for spec in specs:
        name, body = spec.split("=", 1) if "=" in spec else (None, spec)
        shape, dtype = body.split(":", 1) if ":" in body else (body, default_dtype)
        sizes = shape.split("x")
        integer = dtype in _DTYPES and not _DTYPES[dtype].is_floating_point
        widen = [d for d, dim in ((0, "batch"), (1, "sequence")) if dim in dims
                 and len(sizes) > d and sizes[d] == "1" and (dim == "batch" or integer)]
        if not widen or not all(size.isdigit() for size in sizes):  # a bad spec: its error
            out.append(spec)
            continue
        for d in widen:
            sizes[d] = "2"
        new = "x".join(sizes) + (body[len(shape):] if ":" in body else "")
        out.append(f"{name}={new}" if name is not None else new)
        which = " and ".join("batch" if d == 0 else "sequence" for d in widen)
        notes.append(f"--input {spec}: captured at {new}, since export fixes a dimension of "
                     f"size 1; the --dynamic {which} dimension takes any size, 1 included")
    return out, notes


def model_inputs(specs: list[str], default_dtype: str, int_high: int,
                 ) -> tuple[tuple[Any, ...], dict[str, Any]]:
    check_unique_names(specs)
    args: list[Any] = []
    kwargs: dict[str, Any] = {}
    for spec in specs:
        name, tensor = parse_input(spec, default_dtype, int_high)
        if name is None:
            if kwargs:
                raise ModelSpecError(f"--input {spec!r}: positional inputs must come before "
                                     "named ones")
            args.append(tensor)
        else:
            kwargs[name] = tensor
    return tuple(args), kwargs
