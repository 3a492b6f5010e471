"""What a forward call changes besides its outputs, and how to undo it.

Verification runs a model several times; none of those runs may leave a trace (BatchNorm
statistics, counters, the RNG). And a graph can only replay what happens to tensors: a model
whose forward changes Python attributes on every call, runs hooks or custom autograd Functions
needs a capture that keeps those semantics (Dynamo) or eager execution. State a forward writes
once, on its first call (a cache, a flag, hooks it installs for itself), is another matter:
``changed_state``, ``attribute_values`` and ``assign_attributes`` let the capture's probe
(``autoopt.compile.specialize``) keep it, as eager's first call would.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from autoopt.cost_model.isolation import MODULE_INTERNALS, copy_attribute, freeze, preserved

__all__ = ["ABSENT", "HookKey", "StateKey", "assign_attributes", "attribute_copies",
           "attribute_values", "changed_state", "has_hooks", "hook_keys", "own_buffers",
           "preserved", "python_state", "remove_hooks", "state_names", "uses_custom_autograd"]

HOOK_TABLES = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
# Where a hook's options live, under the hook's handle id.
_HOOK_EXTRAS = ("_forward_hooks_with_kwargs", "_forward_hooks_always_called",
                "_forward_pre_hooks_with_kwargs")
StateKey = tuple[str, str]  # (submodule path, attribute name), as python_state keys them


def _user_attributes(module: nn.Module) -> Iterator[tuple[str, str, Any]]:
    for prefix, m in module.named_modules(remove_duplicate=False):
        for key, value in vars(m).items():
            if key not in MODULE_INTERNALS:
                yield prefix, key, value


def python_state(module: nn.Module) -> dict[tuple[str, str], Any]:
    """A comparable snapshot of the non-parameter, non-buffer attributes of every submodule.

    Tensors held as plain attributes are summarised by identity and version counter, so both
    re-assignment and in-place writes show up.
    """
    return {(prefix, key): freeze(value) for prefix, key, value in _user_attributes(module)}


@contextlib.contextmanager
def own_buffers(module: nn.Module) -> Iterator[dict[int, torch.Tensor]]:
    """Run with copies in the module's buffer slots, the buffers put back on exit. Yields
    each buffer by the id of its copy.

    A forward that writes its buffers (a call counter, running statistics) then writes the
    copies: never memory the module may share with the user's model, and no version counter
    that optimized modules sharing that memory watch. A buffer held by several modules gets
    one copy. The slots are set directly, so no assignment hook (``autoopt.module.watch``) fires.
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
        yield {id(copies[id(b)]): b for _, _, b in slots}
    finally:
        for table, name, b in slots:
            table[name] = b


def changed_state(before: dict[StateKey, Any], after: dict[StateKey, Any]) -> list[StateKey]:
    """The attributes that differ between two ``python_state`` snapshots (set, re-assigned,
    changed in place or deleted), in a stable order."""
    return sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))


def state_names(keys: list[StateKey], limit: int = 3) -> str:
    """``stages.0.attn.attention_bias_cache, ...`` for a message."""
    names = [f"{p}.{k}" if p else k for p, k in keys]
    return ", ".join(names[:limit]) + (", ..." if len(names) > limit else "")


ABSENT = object()  # attribute_values' marker for an attribute that is not set


def attribute_values(module: nn.Module, keys: list[StateKey]) -> dict[StateKey, Any]:
    """The objects these attributes hold now (a marker for a deleted one), by reference."""
    return {(p, k): vars(module.get_submodule(p)).get(k, ABSENT) for p, k in keys}


def attribute_copies(module: nn.Module) -> dict[StateKey, Any]:
    """Every attribute ``python_state`` sees, containers copied (as ``preserved`` keeps
    them), so that ``assign_attributes`` can put them back after a call changed them."""
    return {(p, k): copy_attribute(v) for p, k, v in _user_attributes(module)}


def assign_attributes(module: nn.Module, values: dict[StateKey, Any]) -> None:
    """Put ``attribute_values``' objects back in place (deleting the deleted ones)."""
    for (p, k), value in values.items():
        namespace = vars(module.get_submodule(p))
        if value is ABSENT:
            namespace.pop(k, None)
        else:
            namespace[k] = value


HookKey = tuple[str, str, int]  # (submodule path, hook table, handle id)


def hook_keys(module: nn.Module) -> set[HookKey]:
    """Every forward/backward hook registered on the module's submodules (by path, so the
    keys hold for a copy of the module too)."""
    return {(path, name, key) for path, m in module.named_modules() for name in HOOK_TABLES
            for key in (getattr(m, name, None) or {})}


def remove_hooks(module: nn.Module, keys: set[HookKey]) -> None:
    """Remove these hooks (``hook_keys``' entries), with the options kept under their ids."""
    for path, name, key in keys:
        m = module.get_submodule(path)
        for table in (name, *_HOOK_EXTRAS):
            getattr(m, table, {}).pop(key, None)


def has_hooks(module: nn.Module, ignore: set[HookKey] | None = None) -> bool:
    """Whether any module or the global registry holds forward/backward hooks (besides those
    in ``ignore``: ``hook_keys`` entries)."""
    from torch.nn.modules import module as module_impl

    global_hooks = ("_global_forward_hooks", "_global_forward_pre_hooks",
                    "_global_backward_hooks", "_global_backward_pre_hooks")
    if any(getattr(module_impl, name, None) for name in global_hooks):
        return True
    return bool(hook_keys(module) - (ignore or set()))


def uses_custom_autograd(outputs: Any) -> bool:
    """Whether the autograd graph behind ``outputs`` contains a custom ``autograd.Function``,
    whose hand-written backward a traced graph of its forward ops would silently replace."""
    from torch.autograd.function import BackwardCFunction

    from autoopt.check.inputs import leaves

    stack = [leaf.grad_fn for _, leaf in leaves(outputs, "out")
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
