"""Analytical cost of one op: FLOPs, bytes moved, and a roofline time from measured ceilings.

    time = overhead + max(FLOPs / peak FLOP/s, bytes / bandwidth)     (× calibration)

FLOPs come from ``torch.utils.flop_counter`` run on meta tensors (no compute, no memory);
bytes are what the op reads plus what it writes. Ops that return a view move nothing.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import torch
from torch.utils import _pytree as pytree
from torch.utils.flop_counter import FlopCounterMode

from .device import Ceilings

_HALF = (torch.float16, torch.bfloat16)
# Op families calibrated separately: their measured/roofline ratios differ by kernel kind.
_MATMULS = frozenset({"mm", "addmm", "bmm", "matmul", "linear", "baddbmm", "einsum"})


def op_name(target: Any) -> str:
    """A stable name for a node target: ``aten.convolution.default``, ``torch.nn.Linear``."""
    if isinstance(target, torch._ops.OpOverload):
        return str(target)
    if isinstance(target, type):
        return f"{target.__module__}.{target.__qualname__}"
    name = getattr(target, "__qualname__", None) or getattr(target, "__name__", None)
    module = getattr(target, "__module__", None) or ""
    return f"{module}.{name}" if name else str(target)


def op_family(name: str) -> str:
    """``conv``, ``matmul`` or ``other``: the groups the cost model calibrates."""
    parts = name.split(".")
    base = (parts[1] if parts[0] == "aten" and len(parts) > 1 else parts[-1]).lower()
    base = base.split("[", 1)[0]  # a lowered kernel's name carries its bound weight's shape
    if "conv" in base:
        return "conv"
    if base in _MATMULS or "scaled_dot_product" in base:
        return "matmul"
    return "other"


def tensor_spec(t: torch.Tensor) -> str:
    """``f32[1,3,224,224]`` plus ``nc`` when not contiguous: what a cost depends on."""
    dtype = str(t.dtype).replace("torch.", "")
    shape = ",".join(str(int(d)) for d in t.shape)
    return f"{dtype}[{shape}]" + ("" if t.is_contiguous() else "nc")


def value_spec(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return tensor_spec(value)
    if isinstance(value, (list, tuple)):
        return "(" + ",".join(value_spec(v) for v in value) + ")"
    if isinstance(value, (torch.dtype, torch.device, torch.memory_format, torch.layout)):
        return str(value)
    if isinstance(value, float):
        return "f"  # a scalar's value does not change the cost
    if isinstance(value, (int, bool, str)) or value is None:
        return repr(value)
    return type(value).__name__


def is_view(target: Any) -> bool:
    """Whether the op returns an alias of an input (moves no data)."""
    if target is operator.getitem:
        return True
    schema = getattr(target, "_schema", None)
    if schema is None:
        return False
    return any(r.alias_info is not None and not r.alias_info.is_write for r in schema.returns)


def tensor_bytes(value: Any) -> int:
    """The bytes of the tensors in ``value``, a symbolic size (a graph captured with
    ``dynamic=``) counted at the value it was traced with: comparing symbolic byte counts
    (a memory plan's peak) adds guards to the graph, which then serves fewer sizes."""
    return sum(_numel(t) * t.element_size() for t in pytree.tree_leaves(value)
               if isinstance(t, torch.Tensor))


def _numel(t: torch.Tensor) -> Any:
    sizes = [s if isinstance(s, int) else getattr(getattr(s, "node", None), "hint", None)
             for s in t.shape]
    if not all(isinstance(s, int) for s in sizes):
        return t.numel()  # a size with no traced value: symbolic, as it is
    n = 1
    for s in sizes:
        n *= s
    return n


def count_flops(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    """FLOPs of ``fn(*args, **kwargs)``, counted on meta copies of the tensors."""
    def to_meta(t: torch.Tensor) -> torch.Tensor:
        return torch.empty_strided(tuple(int(d) for d in t.shape),
                                   tuple(int(s) for s in t.stride()), dtype=t.dtype,
                                   device="meta")

    try:
        meta_args, meta_kwargs = pytree.tree_map_only(torch.Tensor, to_meta, (args, kwargs))
        # Under its own grad mode: a training graph's ``wrap_with_set_grad_enabled(False, ...)``
        # (a ``no_grad`` block) run on meta tensors left gradients off for the process.
        with torch.no_grad(), FlopCounterMode(display=False) as counter:
            fn(*meta_args, **meta_kwargs)
        return int(counter.get_total_flops())
    except Exception:  # noqa: BLE001 - ops without a meta kernel count as zero FLOPs
        return 0


def roofline_seconds(flops: int, nbytes: int, dtype: torch.dtype | None, ceilings: Ceilings,
                     view: bool = False) -> float:
    """The uncalibrated roofline time of one op."""
    if view:
        return ceilings.op_overhead_s
    peak = ceilings.half_matmul_flops if dtype in _HALF and ceilings.half_matmul_flops else \
        ceilings.matmul_flops
    return ceilings.op_overhead_s + max(flops / peak, nbytes / ceilings.memory_bandwidth)


def bound(flops: int, nbytes: int, seconds: float, ceilings: Ceilings) -> str:
    """``compute``, ``memory`` or ``overhead``: what limits this op on this device."""
    if seconds <= 2 * ceilings.op_overhead_s or (flops == 0 and nbytes == 0):
        return "overhead"
    intensity = flops / max(nbytes, 1)
    ridge = ceilings.matmul_flops / ceilings.memory_bandwidth
    return "compute" if intensity >= ridge else "memory"
