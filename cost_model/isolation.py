"""Runs that leave no trace: what a measuring or verifying run changes is put back.

Every run autoopt makes of a user's model or graph outside the user's own call (verification,
the cost model's profiling, the precision pass's error measurement, pipeline planning) goes
through ``preserved``, so BatchNorm statistics, counters, Python attributes and the RNG are
exactly as they were afterwards. It lives here, in the lowest layer, so that passes and the
cost model can use the same mechanism as the driver.
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
