"""``memory_budget`` applied: plan the captured training graph's saved activations under the
budget and rewrite it to the plan.

``optimize`` calls ``apply_memory_budget`` on a training capture after the passes; the planner is
``autoopt.planning.memory_plan``, the rewrite ``autoopt.runtime.recompute`` and the offload
runtime ``autoopt.runtime.offload``.
"""

from __future__ import annotations

import logging

import torch
from torch import nn
from torch.fx import GraphModule

from autoopt.errors import ConfigError
from autoopt.options.memory import budget_bytes
from autoopt.passes import PassContext
from autoopt.planning.activations import profile_activations
from autoopt.planning.memory_plan import BudgetTooSmall, MemoryPlan, plan_memory
from autoopt.planning.segments import MODES, OFFLOAD, SELECTIVE
from autoopt.runtime.offload import Offload, Offloader
from autoopt.runtime.recompute import SELECTIVE_BACKWARD_TWICE, apply_plan

log = logging.getLogger(__name__)

_SEGMENT_COUNTS = (2, 4, 8, 16, 32)
_UNKNOWN_LINK = 10e9  # bytes/s where the link was not measured (PCIe gen4 x16, about)


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

