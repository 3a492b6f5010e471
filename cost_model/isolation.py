"""Runs that leave no trace: what a measuring or verifying run changes is put back.

Every run autoopt makes of a user's model or graph outside the user's own call (verification,
the cost model's profiling, the precision pass's error measurement, pipeline planning) goes
through ``preserved``, so BatchNorm statistics, counters, Python attributes, the inputs and
the RNG are exactly as they were afterwards; graph runs also take copies of the inputs the graph
writes in place (``unwritten_inputs``), so the caller's tensors are not even written. It lives
here, in the lowest layer, so that passes and the cost model can use the same mechanism as the
driver.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree
from torch.utils.weak import WeakIdKeyDictionary

# Attributes nn.Module keeps for itself; everything else in a module's __dict__ is user state.
MODULE_INTERNALS = frozenset({
    "_parameters", "_buffers", "_modules", "_non_persistent_buffers_set", "training",
    "_forward_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called",
    "_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_backward_hooks",
    "_backward_pre_hooks", "_state_dict_hooks", "_state_dict_pre_hooks",
    "_load_state_dict_pre_hooks", "_load_state_dict_post_hooks", "_is_full_backward_hook",
    "_compiled_call_impl", "__dict__",
})

def freeze(value: Any, depth: int = 0) -> Any:
    """A hashable snapshot of ``value`` that changes when it does: tensors by identity and
    version counter, containers by what they hold, other objects by identity."""
    if isinstance(value, torch.Tensor):
        return ("tensor", id(value), value._version)
    if depth > 4:
        return ("object", id(value))
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, tuple(freeze(v, depth + 1) for v in value))
    if isinstance(value, dict):
        return ("dict", tuple((repr(k), freeze(v, depth + 1)) for k, v in value.items()))
    if isinstance(value, (set, frozenset)):
        return ("set", frozenset(repr(v) for v in value))
    if value is None or isinstance(value, (bool, int, float, complex, str, bytes, torch.dtype,
                                           torch.device)):
        return value
    if isinstance(value, nn.Module) or callable(value):
        return ("object", id(value))
    if hasattr(value, "__dict__"):
        return ("object", id(value), freeze(dict(vars(value)), depth + 1))
    return ("object", id(value))


# Tensors no run writes: constants the passes computed (merged, folded weights), which the
# graph only reads. ``preserved`` copies every other buffer before a run; copying these would
# cost a copy of the derived weights per verification run.
_READ_ONLY = WeakIdKeyDictionary()


def mark_read_only(t: torch.Tensor) -> torch.Tensor:
    """Declare that no run writes ``t`` (a constant a pass computed and only the graph reads),
    so ``preserved`` does not copy it; returns ``t``."""
    _READ_ONLY[t] = True
    return t


def is_read_only(t: torch.Tensor) -> bool:
    """Whether ``t`` was declared a constant no run writes (``mark_read_only``)."""
    return t in _READ_ONLY


@contextlib.contextmanager
def preserved(*state: Any) -> Iterator[None]:
    """Undo, on exit, what a run with ``state`` changes: buffers, Python attributes, the
    tensors it was given, and the RNG.

    Args:
        state: modules (their buffers and Python attributes are put back) and tensors, or
            containers of them (the inputs of the run, which a forward may write in place).

    Tensors are restored in place, so graphs and callers holding them keep seeing the same
    objects, and only where the value differs: a tensor the run did not change, or wrote back
    to the same value, is not written at all. Its version counter then stays where it was, so
    an autograd graph that saved it still accepts it, and nothing watching the counter (an
    optimized module sharing the user's weights, ``autoopt.module.watch``) sees a write that did not
    happen. The RNG of the CPU and of every CUDA device the state is on is restored.

    Example:
        >>> with preserved(model, (x,)):
        ...     cost.profile(gm, [x])
    """
    tensors: dict[int, tuple[torch.Tensor, torch.Tensor, int | None]] = {}
    attributes: list[tuple[nn.Module, str, Any, Any]] = []
    devices: set[int] = set()
    seen: set[int] = set()

    def keep(t: torch.Tensor) -> None:
        if t.device.type == "cuda":
            devices.add(t.device.index if t.device.index is not None
                        else torch.cuda.current_device())
        if id(t) not in tensors and not t.is_meta:
            tensors[id(t)] = (t, t.detach().clone(), _version(t))

    for item in state:
        if not isinstance(item, nn.Module):
            for leaf in pytree.tree_leaves(item):
                if isinstance(leaf, torch.Tensor):
                    keep(leaf)
            continue
        for b in item.buffers():
            if not is_read_only(b):
                keep(b)
        for p in item.parameters():  # not restored (a run does not train), but its RNG is
            if p.device.type == "cuda":
                devices.add(p.device.index if p.device.index is not None
                            else torch.cuda.current_device())
        for m in item.modules():
            if id(m) in seen:
                continue
            seen.add(id(m))
            for key, value in vars(m).items():
                if key not in MODULE_INTERNALS and not isinstance(value, nn.Module):
                    attributes.append((m, key, freeze(value), copy_attribute(value)))
    try:
        with torch.random.fork_rng(devices=sorted(devices)):
            yield
    finally:
        with torch.no_grad():
            for tensor, saved, version in tensors.values():
                _restore(tensor, saved, version)
        # Only what changed is put back, so untouched attributes keep their identity.
        for m, key, frozen, value in attributes:
            if key not in m.__dict__ or freeze(m.__dict__[key]) != frozen:
                m.__dict__[key] = value


def _restore(tensor: torch.Tensor, saved: torch.Tensor, version: int | None) -> None:
    """Put ``saved`` back into ``tensor`` if, and only if, its value changed.

    Comparing first matters: the buffers autoopt runs through are often the user's own memory
    (an inference module shares it), and every write bumps a version counter that optimized
    modules made from the same model watch; a needless write would make them capture again.
    A change the version counter did not see (a write through ``.data``) is undone the same
    way, unseen, so the tensor is exactly as it was, counter included."""
    if tensor.shape != saved.shape or _same(tensor, saved):
        return
    if version is not None and _version(tensor) == version:
        tensor.data.copy_(saved)  # ``.data`` has its own counter: this one stays as it was
    else:
        tensor.copy_(saved)


def _version(t: torch.Tensor) -> int | None:
    try:
        return t._version
    except RuntimeError:  # inference tensors keep no version counter
        return None


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equal (so a NaN equals itself and -0.0 differs from 0.0)."""
    try:
        return bool(torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)))
    except RuntimeError:  # a layout without a byte view (sparse, quantized)
        pass
    try:
        return bool(torch.equal(a, b))
    except (RuntimeError, NotImplementedError):  # nothing compares them: assume it changed
        return False


def copy_attribute(value: Any, depth: int = 0) -> Any:
    """Containers are copied, nested ones too (a forward may append to them); what they hold,
    and anything else, is kept by reference, which restores re-assigned values (counters,
    cached tensors). Never a deep copy: a graph module's ``meta`` holds graph modules, whose
    deep copy would clone every weight on each verification run."""
    if depth > 4 or not isinstance(value, (list, dict, set)):
        return value
    try:
        if isinstance(value, dict):
            copied = copy.copy(value)  # the same type (an OrderedDict, a defaultdict)
            for key, item in value.items():
                copied[key] = copy_attribute(item, depth + 1)
            return copied
        if isinstance(value, list):
            return type(value)(copy_attribute(item, depth + 1) for item in value) \
                if type(value) is list else copy.copy(value)
        return copy.copy(value)
    except Exception:  # noqa: BLE001 - an uncopyable container is restored by reference
        return value


# Ops that update running statistics (arguments 3 and 4) when their ``training`` argument (5)
# is true, though their schema does not say so.
_RUNNING_STATS_OPS = (torch.ops.aten.batch_norm.default, torch.ops.aten.native_batch_norm.default,
                      torch.ops.aten._native_batch_norm_legit.default,
                      torch.ops.aten.instance_norm.default)


def written_arguments(target: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
    """The arguments a call of ``target`` writes in place: what its schema marks written, and
    the running statistics a normalization in training mode updates.

    Works on values and on FX nodes alike (it returns the arguments it was given).
    """
    written: list[Any] = []
    if target in _RUNNING_STATS_OPS and len(args) > 5 and args[5]:
        written += args[3:5]
    schema = getattr(target, "_schema", None)
    if schema is not None and schema.is_mutable:
        for i, argument in enumerate(schema.arguments):
            alias = argument.alias_info
            if alias is not None and alias.is_write:
                written.append(args[i] if i < len(args) else kwargs.get(argument.name))
    return [w for w in written if w is not None]


def written_placeholders(gm: nn.Module) -> list[int]:
    """Positions of a graph's inputs that an op in it writes in place (none known for a module
    that is not a ``GraphModule``)."""
    graph = getattr(gm, "graph", None)
    if graph is None:
        return []
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    written: set[int] = set()
    for node in graph.nodes:
        if node.op == "call_function":
            targets = written_arguments(node.target, node.args, node.kwargs)
            written.update(placeholders.index(t) for t in targets if t in placeholders)
    return sorted(written)


def unwritten_inputs(gm: nn.Module, inputs: Sequence[Any]) -> list[Any]:
    """``inputs``, with copies in place of those ``gm`` writes: a measuring run then leaves the
    caller's tensors unwritten, version counters included."""
    written = set(written_placeholders(gm))
    return [x.detach().clone() if i in written and isinstance(x, torch.Tensor) else x
            for i, x in enumerate(inputs)]
