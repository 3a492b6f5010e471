"""The inputs verification runs on: fresh random sets drawn to look like the example
(``fresh_like``, ``input_sets``), private copies of inputs that no run of autoopt's may write
(``clone_inputs``), and the walk over nested values every comparison and every ONNX name
follows (``leaves``, ``attribute_names``)."""

from __future__ import annotations

import copy
import dataclasses
import logging
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch
from torch.utils import _pytree as pytree

log = logging.getLogger(__name__)


_MAX_DEPTH = 8


def leaves(obj: Any, path: str, depth: int = 0) -> Iterator[tuple[str, Any]]:
    """Yield ``(path, leaf)`` for every tensor or plain value inside ``obj``."""
    if depth > _MAX_DEPTH:
        yield path, obj
    elif isinstance(obj, torch.Tensor):
        yield path, obj
    elif isinstance(obj, Mapping):
        for k in obj:
            yield from leaves(obj[k], f"{path}[{k!r}]", depth + 1)
    elif isinstance(obj, (list, tuple)):
        for i, item in enumerate(obj):
            yield from leaves(item, f"{path}[{i}]", depth + 1)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for name in attribute_names(obj):
            yield from leaves(getattr(obj, name), f"{path}.{name}", depth + 1)
    elif obj is None or isinstance(obj, (bool, int, float, complex, str, bytes, torch.dtype,
                                         torch.device, torch.Size)):
        yield path, obj
    elif hasattr(obj, "__dict__") and not callable(obj):
        # Objects that carry tensors in attributes, such as transformers' KV caches.
        for name in attribute_names(obj):
            yield from leaves(getattr(obj, name), f"{path}.{name}", depth + 1)
    else:
        yield path, type(obj).__name__


def attribute_names(obj: Any) -> list[str]:
    """The attributes of an object that holds values, in the order its leaves are walked: a
    dataclass's fields, else its instance attributes sorted by name. ``capture.objects`` takes
    objects apart in this order, and ONNX output names follow it, so there is one order."""
    state = getattr(obj, "__dict__", None)
    if dataclasses.is_dataclass(obj):
        return [f.name for f in dataclasses.fields(obj) if state is None or f.name in state]
    return sorted(k for k in vars(obj) if not k.startswith("__"))


def fresh_like(value: Any, generator: torch.Generator, empty_row: bool = False) -> Any:
    """A random value of the same type, shape and dtype as ``value``, drawn to look like it.

    Floating tensors get the example's mean and spread (a float 0/1 mask stays a 0/1 mask,
    with some positions masked); an integer 0/1 mask (at least two dimensions, some ones)
    gets another 0/1 pattern with some zeros; other integer tensors (token ids, class
    indices) stay within the example's range so they index the same tables; booleans (masks)
    and non-tensor values are kept, since changing them can change what the model means.
    Parameters are kept as they are. ``empty_row``: a 0/1 mask with a batch of two or more
    gets its first row all zeros (an empty text padded into a batch).
    """
    if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
        return type(value)(fresh_like(v, generator, empty_row) for v in value)
    if isinstance(value, dict):
        return type(value)((k, fresh_like(v, generator, empty_row)) for k, v in value.items())
    if not isinstance(value, torch.Tensor) or isinstance(value, torch.nn.Parameter):
        return value
    if value.numel() == 0 or value.dtype == torch.bool:
        return value.clone()
    if value.is_floating_point():
        finite = value.detach()[torch.isfinite(value.detach())].to(torch.float64)
        if finite.numel() == 0:
            return value.clone()
        if bool(((finite == 0) | (finite == 1)).all()):
            # A float 0/1 mask (attention_mask as floats): noise would turn it into weights
            # the model never sees. Draw another 0/1 pattern instead, with some zeros even
            # where the example had none, so that padded inputs are verified too.
            p = min(max(float(finite.mean()), 0.25), 0.75)
            draw = _mask_draw(value, p, generator, empty_row)
            return draw.to(dtype=value.dtype, device=value.device).requires_grad_(
                value.requires_grad)
        mean = float(finite.mean())
        std = float(finite.std()) if finite.numel() > 1 else 1.0
        std = std if std > 0 else max(abs(mean), 1.0)
        noise = torch.randn(value.shape, generator=generator, dtype=torch.float64)
        out = (noise * std + mean).to(dtype=value.dtype, device=value.device)
        # Keep a non-negative input non-negative (variances, lengths, probabilities).
        if float(finite.min()) >= 0:
            out = out.abs()
        return out.requires_grad_(value.requires_grad)
    if value.is_complex():
        return value.clone()
    if value.dim() >= 2 and bool((value == 1).any()) and bool(((value == 0) | (value == 1)).all()):
        # An integer 0/1 mask (a tokenizer's attention_mask): all ones in the example, the
        # range below would keep it all ones, and padded positions (where ONNX Runtime's
        # attention gave other values than eager's) were never verified. Another 0/1
        # pattern, with some zeros, as for a float mask.
        p = min(max(float(value.double().mean()), 0.25), 0.75)
        draw = _mask_draw(value, p, generator, empty_row)
        return draw.to(dtype=value.dtype, device=value.device)
    # Within the example's observed [min, max], both ends included (randint's end is
    # exclusive): an index table the example fits, the fresh values fit too.
    low, high = int(value.min()), int(value.max())
    if high < torch.iinfo(torch.int64).max:
        out = torch.randint(low, high + 1, value.shape, generator=generator, dtype=torch.int64)
    else:  # high + 1 does not fit: leave out the one top value rather than overflow
        out = torch.randint(low, high, value.shape, generator=generator, dtype=torch.int64)
    return out.to(dtype=value.dtype, device=value.device)


def _mask_draw(value: torch.Tensor, p: float, generator: torch.Generator,
               empty_row: bool) -> torch.Tensor:
    """A 0/1 pattern of ``value``'s shape with ones at rate ``p``; with ``empty_row``, row 0
    of a batch of two or more is all zeros: every kernel of torch's attention gives such a
    row zeros, and ONNX Runtime's translation of it did not (other values, unverified)."""
    draw = torch.rand(value.shape, generator=generator, dtype=torch.float64) < p
    if empty_row and value.dim() >= 2 and value.shape[0] >= 2:
        draw[0] = False
    return draw


# Not 0: a user who seeded 0 to make the example inputs would get the same "fresh" ones.
VERIFY_SEED = 20_241_130


# Replacement draws per random input set on which eager itself raised or went non-finite.
_REDRAWS = 3


class InputSets(list):
    """The example input set followed by random ones, as ``input_sets`` makes them; it can draw
    more of the same kind (``check_all`` replaces a random set eager rejects) and remembers
    what was discarded, so every comparison on the same object sees the same sets."""

    def __init__(self, sets: list[tuple[tuple[Any, ...], dict[str, Any]]],
                 draw: Callable[[], tuple[tuple[Any, ...], dict[str, Any]]] | None = None,
                 ) -> None:
        super().__init__(sets)
        self.draw = draw
        self.redraws_left = _REDRAWS * max(len(sets) - 1, 0)
        # Sets taken out, kept alive: callers memoize eager's results by the sets' ids.
        self.discarded: list[tuple[tuple[Any, ...], dict[str, Any]]] = []
        self.reasons: dict[str, int] = {}  # why, counted

    def note(self) -> str:
        if not self.reasons:
            return ""
        why = "; ".join(f"{reason} ({n})" if n > 1 else reason
                        for reason, n in self.reasons.items())
        kept = f"verified on {len(self)} set(s)" + (" (the example alone)" if len(self) == 1
                                                   else "")
        return f"random input sets discarded: {why}; {kept}"


def input_sets(args: tuple[Any, ...], kwargs: Mapping[str, Any], n_random: int,
               seed: int = VERIFY_SEED) -> InputSets:
    """The example inputs followed by ``n_random`` fresh sets of the same shapes and dtypes.

    The first fresh set's 0/1 masks have a row with every position masked (see
    ``fresh_like``); the others' and later draws' do not, so that a model whose eager output
    for such a row is not finite is still verified on padded inputs.

    The result can draw further sets from the same generator: ``check_all`` replaces a fresh
    set on which eager raises (an index out of range) or gives non-finite values where the
    example did not; such a set says nothing about the optimized version."""
    generator = torch.Generator().manual_seed(seed)
    args, kwargs = tuple(args), dict(kwargs)

    def draw(empty_row: bool = False) -> tuple[tuple[Any, ...], dict[str, Any]]:
        return (tuple(fresh_like(a, generator, empty_row) for a in args),
                {k: fresh_like(v, generator, empty_row) for k, v in kwargs.items()})

    return InputSets([(args, kwargs)] + [draw(empty_row=i == 0) for i in range(n_random)],
                     draw)


def clone_inputs(args: tuple[Any, ...], kwargs: Mapping[str, Any],
                 written: Iterable[int] = (),
                 ) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """A private copy of every input tensor (parameters excepted), each a leaf that requires
    grad where the original did: a forward may write its inputs, and no run of autoopt's may
    write the user's. An object pytree does not know that holds tensors (transformers'
    ``DynamicCache``, a user's state object) is copied whole, its tensors so: the capture's
    runs grew the user's cache (a decode step's logits 0.59 off) and left an fx ``Proxy`` in a
    state object's attribute.

    ``written``: positions in ``args`` copied even where they hold a parameter (a Dynamo
    subgraph takes its parameters as inputs, and one that ends in ``optimizer.step()`` or
    updates a statistic kept in a parameter writes them: each measuring run applied the
    update again)."""
    def copy_tensor(x: torch.Tensor) -> torch.Tensor:
        return x if isinstance(x, torch.nn.Parameter) else _copy_tensor(x)

    def copy_leaf(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return copy_tensor(x)
        tensors = tensors_inside(x)
        if not tensors:
            return x
        memo: dict[int, Any] = {id(t): copy_tensor(t) for t in tensors}
        try:
            return copy.deepcopy(x, memo)
        except Exception as exc:  # noqa: BLE001 - an object that cannot be copied is shared
            log.info("an input of type %s cannot be copied (%s): autoopt's runs see the "
                     "object itself", type(x).__name__, exc)
            return x

    copied_args, copied_kwargs = pytree.tree_map(copy_leaf, (tuple(args), dict(kwargs)))
    written = set(written)
    if written:
        copied_args = tuple(_copy_tensor(original) if i in written and isinstance(
            original, torch.nn.Parameter) else copied for i, (copied, original) in enumerate(
                zip(copied_args, args, strict=True)))
    return copied_args, copied_kwargs


def _copy_tensor(x: torch.Tensor) -> torch.Tensor:
    """A plain tensor copy of ``x`` (a parameter's too), a leaf requiring grad where ``x``
    does."""
    clone = x.detach().clone()
    return clone.requires_grad_() if x.requires_grad and clone.is_floating_point() else clone


def tensors_inside(obj: Any, depth: int = 0) -> list[torch.Tensor]:
    """The tensors an object that is not a tensor holds in its attributes, lists, tuples and
    dicts (a few levels deep)."""
    if depth > 6 or obj is None or isinstance(obj, (bool, int, float, complex, str, bytes,
                                                    torch.dtype, torch.device, type)):
        return []
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (list, tuple, set, frozenset)):
        children: Iterable[Any] = obj
    elif isinstance(obj, dict):
        children = obj.values()
    elif isinstance(obj, torch.nn.Module) or callable(obj) and not hasattr(obj, "__dict__"):
        return []
    elif hasattr(obj, "__dict__") or dataclasses.is_dataclass(obj):
        children = [getattr(obj, name, None) for name in attribute_names(obj)]
    else:
        return []
    return [t for child in children for t in tensors_inside(child, depth + 1)]
