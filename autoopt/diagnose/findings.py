"""The four causes of idle time — data, memory, operators, parallelism — each as a finding:
its share of step time, the numbers behind it, and the autoopt options that fix it."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from autoopt.cost_model import GraphCost, device_info
from autoopt.diagnose.sampler import Utilization
from autoopt.diagnose.workload import StepTimes, Workload, batch_size

CAUSES = ("data", "memory", "operators", "parallelism")
# Findings below this share of step time are not worth a line.
_MIN_SHARE = 0.01
_CAPACITY_WARNING = 0.85


@dataclass(frozen=True)
class Remedy:
    """An autoopt option that addresses a finding.

    Args:
        option: ``precision``, ``fusion``, ``offload``, ``partition``, ``prefetch`` or
            ``batch_size``.
        how: what to write, e.g. ``autoopt.data.prefetch(loader, "cuda")``.
        optimize_kwargs: what ``apply`` passes to ``optimize`` for it (empty: nothing to pass).
    """

    option: str
    how: str
    optimize_kwargs: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Finding:
    """One cause of idle time, its share of step time, the numbers behind it and the fix."""

    cause: str
    title: str
    share: float
    evidence: tuple[tuple[str, str], ...]
    remedies: tuple[Remedy, ...]

    def __str__(self) -> str:
        lines = [f"{self.share:6.1%}  {self.cause}: {self.title}"]
        lines += [f"          {label}: {value}" for label, value in self.evidence]
        lines += [f"          fix ({r.option}): {r.how}" for r in self.remedies]
        return "\n".join(lines)


def find_causes(shares: Mapping[str, float], **context: Any) -> list[Finding]:
    """A finding for each cause that matters, largest share of step time first.

    Args:
        shares: each cause's share of step time.
        **context: the measurements the finders read (``w``, ``median``, ``util``,
            ``launches``, ``cost``, ``fractions``, ``busy``, ``ops``, ``labels``).
    """
    findings = []
    for cause in CAUSES:
        finding = _FINDERS[cause](shares[cause], **context)
        if finding is not None:
            findings.append(finding)
    findings.sort(key=lambda f: -f.share)
    return findings


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f} ms"


def _data_finding(share: float, *, w: Workload, median: StepTimes, launches: dict[str, float],
                  **_: Any) -> Finding | None:
    if share < _MIN_SHARE:
        return None
    evidence = [("waiting for the next batch", f"{_ms(median.data_s)} per step "
                 f"({median.data_s / median.total_s:.0%})"),
                ("host→device copies", f"{_ms(median.transfer_s)} per step"),
                ("compute", f"{_ms(median.compute_s)} per step: the loader delivers "
                 f"{1 / max(median.data_s, 1e-9):.1f} batches/s, the model takes "
                 f"{1 / max(median.compute_s, 1e-9):.1f}")]
    if launches.get("memcpy_s"):
        evidence.append(("HtoD copy kernels", f"{_ms(launches['memcpy_s'])} per step"))
    loader = f"{type(w.source).__name__}" if w.is_loader else "the example inputs"
    remedies = (Remedy("prefetch", f"autoopt.data.prefetch({loader}, {str(w.device)!r}, "
                       "depth=2): load and copy the next batches while this one computes"),
                Remedy("prefetch", "DataLoader(num_workers=N, pin_memory=True, "
                       "persistent_workers=True): load batches in parallel processes"))
    return Finding("data", "input pipeline stalls: the device waits for batches", share,
                   tuple(evidence), remedies[:1] if not w.is_loader else remedies)


def _memory_finding(share: float, *, w: Workload, util: Utilization, cost: GraphCost | None,
                    fractions: dict[str, float], labels: dict[str, str],
                    **_: Any) -> Finding | None:
    used, total = _memory_use(w)
    near_capacity = total > 0 and used / total > _CAPACITY_WARNING
    if share < _MIN_SHARE and not near_capacity:
        return None
    evidence = [("memory-bound ops", f"{fractions['memory']:.0%} of compute time "
                 "(cost model roofline)")]
    remedies = [Remedy("precision", "optimize(..., precision='bf16'): half the bytes per "
                       "element", {"precision": "bf16"}),
                Remedy("fusion", "optimize(...): fuses elementwise chains so intermediates "
                       "stay in registers/cache")]
    if cost is not None:
        by_op: dict[str, list[float]] = {}  # op -> [calls, seconds, bytes]
        for c in cost.nodes:
            if labels.get(c.node) == "memory":
                entry = by_op.setdefault(c.op, [0, 0.0, 0])
                entry[0] += 1
                entry[1] += c.latency_s
                entry[2] += c.bytes
        largest = sorted(by_op.items(), key=lambda kv: -kv[1][1])[:3]
        if largest:
            evidence.append(("largest", ", ".join(
                f"{op} ×{calls:.0f} {seconds * 1e3:.2f} ms at {nbytes / seconds / 1e9:.1f} GB/s"
                for op, (calls, seconds, nbytes) in largest)))
        ceilings = device_info(w.device).ceilings
        if ceilings is not None:
            evidence.append(("device bandwidth", f"{ceilings.memory_bandwidth / 1e9:.0f} GB/s "
                             "(measured copy)"))
    if util.has_gpu and util.mean("gpu_memory_bandwidth_percent") is not None:
        evidence.append(("memory-controller busy",
                         f"{util.mean('gpu_memory_bandwidth_percent'):.0f}% of the time"))
    if total:
        evidence.append(("peak memory", f"{used / 2**30:.2f} GiB of {total / 2**30:.1f} GiB "
                         f"({used / total:.0%})"))
    if near_capacity and w.training:
        remedies.append(Remedy("offload", "optimize(..., training=True, memory_budget=0.7): "
                               "offload or recompute saved activations to fit",
                               {"memory_budget": 0.7}))
    title = "memory-bound ops" + (", memory near capacity" if near_capacity else "")
    return Finding("memory", title, share, tuple(evidence), tuple(remedies))


def _operators_finding(share: float, *, w: Workload, launches: dict[str, float],
                       cost: GraphCost | None, fractions: dict[str, float],
                       labels: dict[str, str], **_: Any) -> Finding | None:
    if share < _MIN_SHARE:
        return None
    evidence = []
    if launches:
        evidence.append(("ops per step", f"{launches['ops']:.0f}, median "
                         f"{launches['op_median_s'] * 1e6:.1f} µs each (profiler)"))
        if launches.get("kernels"):
            evidence.append(("kernel launches per step", f"{launches['kernels']:.0f}"))
    if cost is not None:
        overhead_nodes = [c for c in cost.nodes
                          if labels.get(c.node) == "overhead" and c.latency_s > 0]
        evidence.append(("launch/overhead-bound ops", f"{len(overhead_nodes)} of "
                         f"{sum(1 for c in cost.nodes if c.latency_s > 0)}, "
                         f"{fractions['overhead']:.0%} of compute time"))
        overhead = device_info(w.device).ceilings
        if overhead is not None:
            evidence.append(("per-op overhead on this device",
                             f"{overhead.op_overhead_s * 1e6:.1f} µs (measured)"))
    remedies = (Remedy("fusion", "optimize(...): fewer, larger kernels (the pass pipeline "
                       "folds, fuses and removes ops)"),
                Remedy("batch_size", "a larger batch: the same launches do more work each"))
    return Finding("operators", "many short ops: launch and dispatch overhead", share,
                   tuple(evidence), remedies)


def _parallelism_finding(share: float, *, w: Workload, busy: float, util: Utilization,
                         **_: Any) -> Finding | None:
    if share < _MIN_SHARE:
        return None
    batch = batch_size(w)
    evidence = [("batch size", str(batch) if batch is not None else "unknown")]
    if w.device.type == "cuda":
        evidence.append(("GPU busy during compute", f"{busy:.0%} (kernel time / compute time)"))
        if util.mean("gpu_percent") is not None:
            evidence.append(("SM utilization (NVML)", f"{util.mean('gpu_percent'):.0f}%"))
        if torch.cuda.device_count() > 1:
            evidence.append(("devices", f"{torch.cuda.device_count()} GPUs, the model uses 1"))
    else:
        evidence.append(("CPU busy during compute", f"{busy:.0%} of "
                         f"{torch.get_num_threads()} intra-op thread(s)"))
    remedies = [Remedy("batch_size", "a larger batch, so each op has enough parallel work")]
    if w.device.type == "cuda" and torch.cuda.device_count() > 1:
        devices = tuple(f"cuda:{i}" for i in range(torch.cuda.device_count()))
        remedies.append(Remedy("partition", f"optimize(..., devices={list(devices)}): one "
                               "pipeline stage per device", {"devices": devices}))
    return Finding("parallelism", "the device is idle inside compute: too little parallel "
                   "work", share, tuple(evidence), tuple(remedies))


def _memory_use(w: Workload) -> tuple[int, int]:
    """(peak bytes this run used, bytes the device has): the caching allocator's peak on a
    GPU, the process's peak resident size on a CPU."""
    if w.device.type == "cuda":
        total = torch.cuda.get_device_properties(w.device).total_memory
        return int(torch.cuda.max_memory_allocated(w.device)), int(total)
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    return int(peak), int(device_info(w.device, measure=False).memory_total)


_FINDERS: dict[str, Callable[..., Finding | None]] = {
    "data": _data_finding, "memory": _memory_finding, "operators": _operators_finding,
    "parallelism": _parallelism_finding}
