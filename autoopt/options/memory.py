"""``memory_budget``: parse it, plan the captured training graph under it, apply the plan.

The budget bounds the activations autograd saves for backward (parameters, gradients and
optimizer state are not part of it). ``optimize`` calls ``apply_memory_budget`` on a training
capture after the passes; the planner is ``autoopt.passes.memory_plan``, the rewrite
``autoopt.runtime.recompute`` and the offload runtime ``autoopt.runtime.offload``.
"""

from __future__ import annotations

import logging
import re
from typing import Any

import torch
from torch import nn
from torch.fx import GraphModule

from autoopt.errors import ConfigError
from autoopt.passes import PassContext
from autoopt.planning.activations import profile_activations
from autoopt.planning.memory_plan import BudgetTooSmall, MemoryPlan, plan_memory
from autoopt.planning.segments import MODES, OFFLOAD, SELECTIVE
from autoopt.runtime.offload import Offload, Offloader
from autoopt.runtime.recompute import SELECTIVE_BACKWARD_TWICE, apply_plan

log = logging.getLogger(__name__)

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_SEGMENT_COUNTS = (2, 4, 8, 16, 32)
_UNKNOWN_LINK = 10e9  # bytes/s where the link was not measured (PCIe gen4 x16, about)
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([a-z]*)\s*$", re.IGNORECASE)


def parse_budget(value: Any, name: str = "memory_budget",
                 fraction_of: str = "device memory") -> int | float:
    """Check a ``memory_budget``: bytes (int), a fraction of device memory in (0, 1] (float),
    or a size string (``"8GiB"``, ``"512MiB"``, ``"1.5GB"``); returns bytes or the fraction.
    ``name`` and ``fraction_of`` say which option it is in the error (``optimize_memory``).

    Raises:
        ConfigError: anything else, zero or negative.
    """
    hint = (f"{name} is bytes (an int), a fraction of {fraction_of} in (0, 1] (a float) "
            "or a size string like '8GiB' or '512MiB'")
    if isinstance(value, bool):
        raise ConfigError(f"{hint}; got {value!r}")
    if isinstance(value, int):
        if value <= 0:
            raise ConfigError(f"{hint}; got {value}, which is not positive")
        return value
    if isinstance(value, float):
        if not 0 < value <= 1:
            raise ConfigError(f"{hint}; got the float {value}, outside (0, 1] (pass bytes as "
                              f"an int or a string)")
        return value
    if isinstance(value, str):
        match = _SIZE.match(value)
        unit = match.group(2).lower() if match else ""
        if match is None or unit not in _UNITS:
            raise ConfigError(f"{hint}; cannot read {value!r} (units: B, KB, MB, GB, KiB, MiB, "
                              f"GiB)")
        size = int(float(match.group(1)) * _UNITS[unit])
        if size <= 0:
            raise ConfigError(f"{hint}; got {value!r}, which is not positive")
        return size
    raise ConfigError(f"{hint}; got {type(value).__name__} {value!r}")


def parse_modes(modes: Any) -> tuple[str, ...]:
    """Check ``memory_modes``: a non-empty subset of ``keep``, ``offload``, ``selective``,
    ``recompute`` (``keep`` is allowed whatever is asked: a segment may stay as it is)."""
    chosen = (modes,) if isinstance(modes, str) else tuple(modes)
    bad = [m for m in chosen if m not in MODES]
    if bad or not chosen:
        raise ConfigError(f"memory_modes must be drawn from {list(MODES)}; got {list(chosen)}")
    return chosen


def budget_bytes(budget: int | float, device_memory: int) -> int:
    """Bytes for a parsed budget: a fraction is of ``device_memory``."""
    return int(budget * device_memory) if isinstance(budget, float) else int(budget)


def plan_for(gm: GraphModule, ctx: PassContext, budget: int | float,
             modes: tuple[str, ...] | None = None) -> MemoryPlan:
    """Plan ``gm``'s saved activations under ``budget``, priced by ``ctx.cost``.

    The graph is cut into 2, 4, ... 32 segments; the plan of least added time over those cuts
    wins (few long segments recompute cheaply per byte, many short ones fit tighter budgets).
    Offload is priced over the measured host link on a GPU; on a CPU the host is both ends, so
    offload frees nothing and is used only when ``modes`` asks for it (tests).

    Raises:
        ConfigError: no plan fits; the message names the smallest budget that does.
    """
    cost = ctx.cost
    info = cost.info if cost is not None else None
    device_memory = info.memory_total if info is not None else 0
    if isinstance(budget, float) and not device_memory:
        raise ConfigError("memory_budget is a fraction of device memory, but this device's "
                          "memory size is unknown; pass bytes or a string like '8GiB'")
    limit = budget_bytes(budget, device_memory)
    if not ctx.example_inputs:
        # Not the user's error: this capture cannot be planned, the next method may be.
        raise RuntimeError("memory_budget needs the captured graph's example inputs, which "
                           "could not be matched to its placeholders")
    profile = profile_activations(gm, ctx.example_inputs, cost)
    on_gpu = ctx.device.type == "cuda"
    notes: list[str] = []
    if modes is None:
        modes = MODES if on_gpu else tuple(m for m in MODES if m != OFFLOAD)
        notes.append("modes: the default on this device" + (
            "" if on_gpu else " (no offload: on a CPU the host is both ends, so it frees "
                              "nothing)"))
        if not SELECTIVE_BACKWARD_TWICE:
            # Nobody announces a double backward in advance: by default, only what supports it.
            modes = tuple(m for m in modes if m != SELECTIVE)
            notes.append(f"selective recompute left out: under torch {torch.__version__} it "
                         f"supports one backward per forward only (no retain_graph=True, no "
                         f"double backward); memory_modes=(..., 'selective') asks for it")
    elif SELECTIVE in modes and not SELECTIVE_BACKWARD_TWICE:
        notes.append(f"selective recompute under torch {torch.__version__} supports one "
                     f"backward per forward only (no retain_graph=True, no double backward)")
    # The host link on a GPU; on a CPU a copy within host memory (read plus write).
    ceilings = info.ceilings if info is not None else None
    bandwidth = 0.0
    if ceilings is not None:
        bandwidth = ceilings.host_link_bandwidth if on_gpu else ceilings.memory_bandwidth / 2
    plans, refusals = [], []
    for count in _SEGMENT_COUNTS:
        segments, activations = profile.segments(count)
        try:
            plans.append(plan_memory(segments, limit, modes=modes,
                                     link_bandwidth=bandwidth or _UNKNOWN_LINK, overlap=on_gpu,
                                     activations=activations, notes=notes))
        except BudgetTooSmall as exc:
            refusals.append(exc)
        if len(segments) < count:
            break  # fewer nodes than segments: finer cuts are the same cut
    if not plans:
        smallest = min(refusals, key=lambda e: e.smallest)
        raise ConfigError(f"memory_budget={budget!r} cannot be met: {smallest}. Pass "
                          f"memory_budget={smallest.smallest} or more, or lower the batch "
                          f"size.")
    plan = min(plans, key=lambda p: (p.added_seconds, len(p.segments)))
    log.info("%s", plan.describe())
    return plan


def apply_memory_budget(gm: GraphModule, ctx: PassContext, budget: int | float,
                        modes: tuple[str, ...] | None = None,
                        ) -> tuple[GraphModule, MemoryPlan]:
    """Plan ``gm`` under ``budget`` and return the module that follows the plan."""
    plan = plan_for(gm, ctx, budget, modes)
    keep = {t.untyped_storage().data_ptr() for t in (*gm.parameters(), *gm.buffers())}
    offloader = Offloader(ctx.device, keep)

    def offload(segment: nn.Module, index: int) -> nn.Module:
        return Offload(segment, offloader, index)

    planned = apply_plan(gm, plan, offload)
    planned.meta = dict(getattr(gm, "meta", {}))
    planned.meta["memory_plan"] = plan
    planned.meta["offloader"] = offloader
    return planned, plan

