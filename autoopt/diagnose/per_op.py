"""Per-op evidence for the diagnosis: each op's time from ``torch.profiler``, the cost model's
roofline of the model's graph, and what limits each node (compute, memory or launch overhead).
"""

from __future__ import annotations

import logging
import statistics
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from autoopt.cost_model import CostModel, GraphCost, device_info
from autoopt.diagnose.quiet import quiet_kineto
from autoopt.diagnose.workload import Progress, Workload

log = logging.getLogger(__name__)

# An op is launch/dispatch-bound when its roofline work is under this share of its time and
# it lasts under this many per-op overheads (longer ops that slow are inefficient kernels).
_OVERHEAD_WORK = 0.25
_SHORT_OPS = 50


@dataclass(frozen=True)
class OpTime:
    """One op's time per step in the profiled run (``torch.profiler``: the op as the model
    called it, with the time of the ops and kernels beneath it)."""

    name: str
    calls: float
    seconds: float
    bound: str = ""


def profile_ops(w: Workload, batches: Iterator[Any], steps: int, progress: Progress,
                ) -> tuple[list[OpTime], dict[str, float]]:
    """Per-op time per step (inclusive of the kernels beneath), and launch counts, from
    ``torch.profiler``."""
    if steps == 0:
        return [], {}
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if w.device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    with quiet_kineto(gpu=w.device.type == "cuda"), profile(activities=activities) as prof:
        for _ in progress(range(steps), "profiled steps"):
            w.step(batches)
    events = prof.events()
    top_level = [e for e in events if e.name.startswith("aten::")
                 and not (e.cpu_parent is not None and e.cpu_parent.name.startswith("aten::"))]
    kernels = [e for e in events if getattr(e, "device_type", None) is not None
               and str(e.device_type).endswith("CUDA") and not e.name.startswith("aten::")]
    # Ops as the model called them (``aten::conv2d``, not the kernels under it), with the time
    # of everything beneath them: these names match the graph's nodes and the roofline.
    on_device = w.device.type == "cuda"
    totals: dict[str, list[float]] = {}
    for e in top_level:
        entry = totals.setdefault(e.name, [0.0, 0.0])
        entry[0] += 1
        entry[1] += (e.device_time_total if on_device else e.cpu_time_total) * 1e-6
    ops = [OpTime(name, calls / steps, seconds / steps)
           for name, (calls, seconds) in totals.items() if seconds > 0]
    ops.sort(key=lambda o: -o.seconds)
    memcpy = [k for k in kernels if "memcpy" in k.name.lower() and "htod" in k.name.lower()]
    launches = {"ops": len(top_level) / steps,
                "op_median_s": statistics.median([e.cpu_time_total * 1e-6 for e in top_level])
                if top_level else 0.0,
                "kernels": len(kernels) / steps,
                "kernel_s": sum(k.device_time_total for k in kernels
                                if k not in memcpy) * 1e-6 / steps if kernels else 0.0,
                "memcpy_s": sum(k.device_time_total for k in memcpy) * 1e-6 / steps}
    return ops, launches


def roofline_cost(w: Workload, progress: Progress) -> GraphCost | None:
    """The cost model's per-node profile of the model's graph, or None if it has none."""
    from autoopt.capture.graph import export_graph, flat_example_inputs
    from autoopt.module.optimized import OptimizedModule

    args, kwargs = w.example()
    # An OptimizedModule: the graph it runs, else its private copy of the model is exported.
    module = w.model.module if isinstance(w.model, OptimizedModule) else w.model
    gm = _optimized_graph(w.model)
    try:
        if gm is None:
            with torch.no_grad():
                gm = export_graph(module.eval(), args, kwargs)
            module.train(w.training)
        for _ in progress([0], "roofline (cost model)"):
            cost = CostModel(w.device).profile(gm, list(flat_example_inputs(gm, args, kwargs)))
        return cost
    except Exception as exc:  # noqa: BLE001 - no graph: the diagnosis goes on without labels
        log.info("no roofline for this model: %s", exc)
        module.train(w.training)
        return None


def _optimized_graph(model: nn.Module) -> torch.fx.GraphModule | None:
    for spec in getattr(model, "specializations", ()):
        if isinstance(spec.graph, torch.fx.GraphModule):
            return spec.graph
    return None


def roofline_labels(cost: GraphCost, device: torch.device) -> dict[str, str]:
    """Each node's limit in the measured run: ``overhead`` when its roofline work (FLOPs at
    peak, bytes at full bandwidth) is under a quarter of its time and the op is short (under
    50 per-op overheads), so launch and dispatch dominate; else ``compute`` or ``memory`` by
    arithmetic intensity against the device's ridge point."""
    ceilings = device_info(device).ceilings
    labels = {}
    for c in cost.nodes:
        if ceilings is None or c.latency_s <= 0:
            labels[c.node] = c.bound
            continue
        work = max(c.flops / ceilings.matmul_flops, c.bytes / ceilings.memory_bandwidth)
        if work < _OVERHEAD_WORK * c.latency_s and c.latency_s < _SHORT_OPS * \
                ceilings.op_overhead_s:
            labels[c.node] = "overhead"
        elif c.flops / max(c.bytes, 1) >= ceilings.matmul_flops / ceilings.memory_bandwidth:
            labels[c.node] = "compute"
        else:
            labels[c.node] = "memory"
    return labels


def bound_by_op(cost: GraphCost, labels: dict[str, str]) -> dict[str, str]:
    """``aten::addmm`` -> the limit that holds most of its time in the cost profile."""
    seconds: dict[str, Counter[str]] = {}
    for c in cost.nodes:
        if c.op.startswith("aten."):
            name = "aten::" + c.op.split(".")[1]
            seconds.setdefault(name, Counter())[labels[c.node]] += c.latency_s
    return {name: counts.most_common(1)[0][0] for name, counts in seconds.items()}
