"""What a forward call changes besides its outputs, and how to undo it.

Verification runs a model several times; none of those runs may leave a trace (BatchNorm
statistics, counters, the RNG). And a graph can only replay what happens to tensors: a model
whose forward changes Python attributes, runs hooks or custom autograd Functions needs a
capture that keeps those semantics (Dynamo) or eager execution.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

# Attributes nn.Module keeps for itself; everything else in a module's __dict__ is user state.
_MODULE_INTERNALS = frozenset({
    "_parameters", "_buffers", "_modules", "_non_persistent_buffers_set", "training",
    "_forward_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called",
    "_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_backward_hooks",
    "_backward_pre_hooks", "_state_dict_hooks", "_state_dict_pre_hooks",
    "_load_state_dict_pre_hooks", "_load_state_dict_post_hooks", "_is_full_backward_hook",
    "_compiled_call_impl", "__dict__",
})
_HOOK_DICTS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")


def _user_attributes(module: nn.Module) -> Iterator[tuple[str, str, Any]]:
    for prefix, m in module.named_modules(remove_duplicate=False):
        for key, value in vars(m).items():
            if key not in _MODULE_INTERNALS:
                yield prefix, key, value


def python_state(module: nn.Module) -> dict[tuple[str, str], Any]:
    """A comparable snapshot of the non-parameter, non-buffer attributes of every submodule.

    Tensors held as plain attributes are summarised by identity and version counter, so both
    re-assignment and in-place writes show up.
    """
    return {(prefix, key): _freeze(value) for prefix, key, value in _user_attributes(module)}


def _freeze(value: Any, depth: int = 0) -> Any:
    if isinstance(value, torch.Tensor):
        return ("tensor", id(value), value._version)
    if depth > 4:
        return ("object", id(value))
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, tuple(_freeze(v, depth + 1) for v in value))
    if isinstance(value, dict):
        return ("dict", tuple((repr(k), _freeze(v, depth + 1)) for k, v in value.items()))
    if isinstance(value, (set, frozenset)):
        return ("set", frozenset(repr(v) for v in value))
    if value is None or isinstance(value, (bool, int, float, complex, str, bytes, torch.dtype,
                                           torch.device)):
        return value
    if isinstance(value, nn.Module) or callable(value):
        return ("object", id(value))
    if hasattr(value, "__dict__"):
        return ("object", id(value), _freeze(dict(vars(value)), depth + 1))
    return ("object", id(value))


@contextlib.contextmanager
def preserved(*modules: nn.Module) -> Iterator[None]:
    """Undo, on exit, what running the modules changes: buffers, Python attributes, RNG.

    Buffers are restored in place so that graphs holding them keep seeing the same tensors.
    """
    buffers: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    attributes: list[tuple[nn.Module, str, Any, Any]] = []
    seen: set[int] = set()
    for module in modules:
        for b in module.buffers():
            buffers.setdefault(id(b), (b, b.detach().clone()))
        for m in module.modules():
            if id(m) in seen:
                continue
            seen.add(id(m))
            for key, value in vars(m).items():
                if key not in _MODULE_INTERNALS and not isinstance(value, nn.Module):
                    attributes.append((m, key, _freeze(value), _copy_attribute(value)))
    devices = sorted({b.device.index for b, _ in buffers.values()
                      if b.device.type == "cuda" and b.device.index is not None})
    try:
        with torch.random.fork_rng(devices=devices):
            yield
    finally:
        with torch.no_grad():
            for tensor, saved in buffers.values():
                if tensor.shape == saved.shape:
                    tensor.copy_(saved)
        # Only what changed is put back, so untouched attributes keep their identity.
        for m, key, frozen, value in attributes:
            if key not in m.__dict__ or _freeze(m.__dict__[key]) != frozen:
                m.__dict__[key] = value


def _copy_attribute(value: Any) -> Any:
    """Containers are copied (a forward may append to them); anything else is kept by reference,
    which restores re-assigned values (counters, cached tensors)."""
    if not isinstance(value, (list, dict, set)):
        return value
    try:
        return copy.deepcopy(value)
    except Exception:  # noqa: BLE001 - an uncopyable container is restored by reference
        return value


def has_hooks(module: nn.Module) -> bool:
    """Whether any module or the global registry holds forward/backward hooks."""
    from torch.nn.modules import module as module_impl

    global_hooks = ("_global_forward_hooks", "_global_forward_pre_hooks",
                    "_global_backward_hooks", "_global_backward_pre_hooks")
    if any(getattr(module_impl, name, None) for name in global_hooks):
        return True
    return any(getattr(m, name, None) for m in module.modules() for name in _HOOK_DICTS)


def uses_custom_autograd(outputs: Any) -> bool:
    """Whether the autograd graph behind ``outputs`` contains a custom ``autograd.Function``,
    whose hand-written backward a traced graph of its forward ops would silently replace."""
    from torch.autograd.function import BackwardCFunction

    from .verify import _leaves

    stack = [leaf.grad_fn for _, leaf in _leaves(outputs, "out")
             if isinstance(leaf, torch.Tensor) and leaf.grad_fn is not None]
    seen: set[int] = set()
    while stack:
        fn = stack.pop()
        if fn is None or id(fn) in seen:
            continue
        seen.add(id(fn))
        if isinstance(fn, BackwardCFunction):
            return True
        stack.extend(next_fn for next_fn, _ in fn.next_functions)
    return False
