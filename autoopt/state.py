"""What a forward call changes besides its outputs, and how to undo it.

Verification runs a model several times; none of those runs may leave a trace (BatchNorm
statistics, counters, the RNG). And a graph can only replay what happens to tensors: a model
whose forward changes Python attributes, runs hooks or custom autograd Functions needs a
capture that keeps those semantics (Dynamo) or eager execution.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from .cost_model.isolation import _MODULE_INTERNALS, _freeze, preserved

__all__ = ["has_hooks", "own_buffers", "preserved", "python_state", "uses_custom_autograd"]

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


@contextlib.contextmanager
def own_buffers(module: nn.Module) -> Iterator[None]:
    """Run with copies in the module's buffer slots, the buffers put back on exit.

    A forward that writes its buffers (a call counter, running statistics) then writes the
    copies: never memory the module may share with the user's model, and no version counter
    that optimized modules sharing that memory watch. A buffer held by several modules gets
    one copy. The slots are set directly, so no assignment hook (``autoopt.watch``) fires.
    Inference tensors are left in place (they have no version counter to move).
    """
    copies: dict[int, torch.Tensor] = {}
    slots: list[tuple[dict[str, Any], str, torch.Tensor]] = []
    for m in module.modules():
        for name, b in m._buffers.items():
            if b is None or b.is_inference():
                continue
            if id(b) not in copies:
                copies[id(b)] = b.detach().clone().requires_grad_(b.requires_grad)
            slots.append((m._buffers, name, b))
    for table, name, b in slots:
        table[name] = copies[id(b)]
    try:
        yield
    finally:
        for table, name, b in slots:
            table[name] = b


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
