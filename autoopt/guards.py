"""The input signature a captured graph is valid for.

A graph bakes in what was constant at capture: the input structure, static shapes, dtypes,
devices, non-tensor argument values, train/eval modes, grad mode. A call whose signature
differs is re-captured (or runs eagerly), never replayed on a stale graph.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.fx import GraphModule
from torch.utils import _pytree as pytree


@dataclass(frozen=True)
class TensorSpec:
    dtype: torch.dtype
    device: torch.device
    shape: tuple[int | None, ...]  # None where the graph is dynamic in that dimension

    def matches(self, t: torch.Tensor) -> bool:
        return (t.dtype == self.dtype and t.device == self.device and t.dim() == len(self.shape)
                and all(s is None or s == d for s, d in zip(self.shape, t.shape, strict=True)))

    def __str__(self) -> str:
        dims = ", ".join("?" if d is None else str(d) for d in self.shape)
        return f"{str(self.dtype).replace('torch.', '')}[{dims}]"


@dataclass(frozen=True)
class InputSignature:
    """Structure and per-leaf specs of ``(args, kwargs)`` plus the modes the graph assumed."""

    tree: pytree.TreeSpec
    leaves: tuple[Any, ...]  # TensorSpec for tensors, the value itself otherwise
    modes: tuple[bool, ...]
    flat_keys: tuple[str, ...] | None = None  # kwargs names when no input is a container

    def matches(self, args: tuple[Any, ...], kwargs: Mapping[str, Any],
                modes: tuple[bool, ...]) -> bool:
        if modes != self.modes:
            return False
        leaves = _flat_leaves(args, kwargs) if self.flat_keys is not None else None
        if leaves is not None:
            # Fast path (no containers among the inputs): pytree's flatten costs more than a
            # small model's forward.
            if len(args) + len(kwargs) != len(self.leaves) or tuple(kwargs) != self.flat_keys:
                return False
        else:
            leaves, tree = pytree.tree_flatten((tuple(args), dict(kwargs)))
            if tree != self.tree or len(leaves) != len(self.leaves):
                return False
        for spec, value in zip(self.leaves, leaves, strict=True):
            if isinstance(spec, TensorSpec):
                if not isinstance(value, torch.Tensor) or not spec.matches(value):
                    return False
            elif isinstance(value, torch.Tensor) or not _same_value(spec, value):
                return False
        return True

    def describe(self) -> str:
        parts = [str(s) if isinstance(s, TensorSpec) else repr(s) for s in self.leaves]
        return ", ".join(parts) if parts else "(no inputs)"


def _same_value(a: Any, b: Any) -> bool:
    if a is b:
        return True
    if type(a) is not type(b):
        return False
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - incomparable values count as different
        return False


def current_modes(module: nn.Module, submodules: list[nn.Module] | None = None,
                  ) -> tuple[bool, ...]:
    """Grad mode and every submodule's ``training`` flag. (A graph captured without grad runs
    as well under ``inference_mode``; one captured with grad keeps parameter gradients.)"""
    modules = module.modules() if submodules is None else submodules
    return (torch.is_grad_enabled(), *(m.training for m in modules))


def signature_of(args: tuple[Any, ...], kwargs: Mapping[str, Any], module: nn.Module,
                 gm: GraphModule | None = None) -> InputSignature:
    """The signature of these inputs; dimensions the graph ``gm`` keeps symbolic are free."""
    leaves, tree = pytree.tree_flatten((tuple(args), dict(kwargs)))
    dynamic = _dynamic_dims(gm, len(leaves)) if gm is not None else {}
    specs: list[Any] = []
    for i, value in enumerate(leaves):
        if isinstance(value, torch.Tensor):
            free = dynamic.get(i, set())
            shape = tuple(None if d in free else int(s) for d, s in enumerate(value.shape))
            specs.append(TensorSpec(value.dtype, value.device, shape))
        else:
            specs.append(value)
    flat_keys = tuple(kwargs) if _flat_leaves(args, kwargs) is not None else None
    return InputSignature(tree, tuple(specs), current_modes(module), flat_keys)


def _flat_leaves(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> list[Any] | None:
    """The inputs as they are when none is a container pytree would walk into, else None."""
    leaves = [*args, *kwargs.values()]
    for value in leaves:
        if isinstance(value, (list, tuple, dict)) or (
                not isinstance(value, torch.Tensor) and pytree._get_node_type(value)
                in pytree.SUPPORTED_NODES):
            return None
    return leaves


def _dynamic_dims(gm: GraphModule, n_leaves: int) -> dict[int, set[int]]:
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != n_leaves:
        return {}
    dims: dict[int, set[int]] = {}
    for i, node in enumerate(placeholders):
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor):
            free = {d for d, s in enumerate(val.shape) if not isinstance(s, int)}
            if free:
                dims[i] = free
    return dims
