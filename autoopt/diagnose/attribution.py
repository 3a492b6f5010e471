"""Step time split into the four causes (data, memory, operators, parallelism) from the
phase timings, the utilization samples, the per-op profile and the cost model's roofline
labels; a finding is written for each cause that matters."""

from __future__ import annotations

import dataclasses
import statistics
from collections import Counter
from dataclasses import dataclass

import torch

from autoopt.cost_model import GraphCost
from autoopt.diagnose.findings import Finding, find_causes
from autoopt.diagnose.per_op import OpTime, bound_by_op, roofline_labels
from autoopt.diagnose.sampler import Utilization
from autoopt.diagnose.workload import StepTimes, Workload

# Below this share of its threads' time busy while every core is this busy (percent), the
# process was waiting for cores other processes held: the CPU was shared.
_CONTENDED_BUSY = 0.9
_CONTENDED_CPU = 85.0


@dataclass
class Attribution:
    """The findings, the median step's phases, each cause's share of step time, the ops with
    their bound, and notes on how the split was made."""

    findings: list[Finding]
    step: StepTimes
    shares: dict[str, float]
    ops: list[OpTime]
    notes: list[str]


def attribute(w: Workload, timings: list[tuple[float, float, float, float]],
               process_cpu: float, util: Utilization, ops: list[OpTime],
               launches: dict[str, float], cost: GraphCost | None, steps: int) -> Attribution:
    """Split step time into the four causes and write a finding for each that matters."""
    data, transfer, compute, total = (sum(col) for col in zip(*timings, strict=True))
    median = StepTimes(*(statistics.median(col) for col in zip(*timings, strict=True)))
    notes: list[str] = []
    fractions = {"compute": 1.0, "memory": 0.0, "overhead": 0.0}
    labels: dict[str, str] = {}
    if cost is not None and cost.latency_s > 0:
        labels = roofline_labels(cost, w.device)
        by_bound = Counter[str]()
        for c in cost.nodes:
            by_bound[labels[c.node]] += c.latency_s
        fractions = {b: by_bound[b] / cost.latency_s for b in ("compute", "memory", "overhead")}
        bounds = bound_by_op(cost, labels)
        ops = [dataclasses.replace(o, bound=bounds.get(o.name, "")) for o in ops]
        if w.training:
            notes.append("roofline labels come from the forward graph; backward is assumed "
                         "to split the same way")
    else:
        notes.append("no whole graph for the cost model (torch.export failed or roofline=False)"
                     ": compute time is not split by memory/overhead")
    busy = _busy_fraction(w, process_cpu, compute, launches, steps)
    machine = util.mean("cpu_percent")
    if w.device.type == "cpu" and busy < _CONTENDED_BUSY and (machine or 0) >= _CONTENDED_CPU:
        # Our threads were runnable but the cores were taken: that idle time says nothing
        # about the model's parallelism, so it goes to "other", with a note.
        notes.append(f"the CPU was shared: all cores were {machine:.0f}% busy while this "
                     f"process got {busy:.0%} of its {torch.get_num_threads()} thread(s) "
                     "during compute; other processes inflate these timings. Rerun on an "
                     "idle machine.")
        busy = 1.0
    compute_share = compute / total
    shares = {
        "data": (data + transfer) / total,
        "memory": compute_share * fractions["memory"],
        "operators": compute_share * fractions["overhead"],
        "parallelism": compute_share * fractions["compute"] * (1 - busy),
    }
    shares["useful compute"] = compute_share * fractions["compute"] * busy
    shares["other"] = max(0.0, 1.0 - sum(shares.values()))
    context = dict(w=w, median=median, util=util, launches=launches, cost=cost,
                   fractions=fractions, busy=busy, ops=ops, labels=labels)
    return Attribution(find_causes(shares, **context), median, shares, ops, notes)


def _busy_fraction(w: Workload, process_cpu: float, compute: float,
                   launches: dict[str, float], steps: int) -> float:
    """Share of the compute phase the device was working: kernel time on a GPU, the
    process's CPU time over the intra-op threads on a CPU."""
    if compute <= 0:
        return 1.0
    if w.device.type == "cuda":
        per_step = compute / steps
        return min(1.0, launches.get("kernel_s", 0.0) / per_step) if launches else 1.0
    return min(1.0, process_cpu / compute / torch.get_num_threads())
