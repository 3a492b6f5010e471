"""Why the device is idle: run a workload, measure it, and name the causes with their evidence.

    diagnosis = autoopt.diagnose(model, loader, training=True, steps=20)
    print(diagnosis)                 # findings ranked by share of step time, each with a fix
    result = diagnosis.apply()       # optimize with those fixes; before/after step time

Each step of the workload is timed in three phases: waiting for the next batch (the loader),
copying it to the device, and computing (forward, and backward when training). The sampler
records utilization all along, ``torch.profiler`` records a few steps op by op, and the cost
model's roofline labels every graph node compute-, memory- or overhead-bound. Step time is
then attributed to four causes:

1. ``data``: time waiting for batches and in host→device copies;
2. ``memory``: compute time in memory-bound ops (and memory near capacity);
3. ``operators``: compute time in ops no longer than a few launches (many small kernels);
4. ``parallelism``: compute time the device sits idle in compute-bound ops (small batch, a
   slow host thread, one device of several doing everything).
"""

from __future__ import annotations

import dataclasses
import statistics
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..cost_model import GraphCost
from ..errors import ConfigError, ModelError
from .findings import Finding, Remedy, find_causes
from .mfu import StepFlops, step_flops
from .per_op import OpTime, bound_by_op, profile_ops, roofline_cost, roofline_labels
from .sampler import Utilization, UtilizationSampler
from .workload import Progress, StepTimes, Workload, batch_size

# On a CPU: the process got under this share of its threads while the cores were this busy
# (percent): other processes held the CPU.
_CONTENDED_BUSY = 0.9
_CONTENDED_CPU = 85.0


@dataclass
class Diagnosis:
    """What ``diagnose`` found; ``findings`` are ranked by share of step time."""

    findings: list[Finding]
    step: StepTimes
    shares: dict[str, float]
    device: str
    training: bool
    steps: int
    batch_size: int | None
    utilization: Utilization
    ops: list[OpTime]
    cost: GraphCost | None
    notes: list[str]
    workload: Workload | None = field(default=None, repr=False)
    # The model's FLOPs per step against the device's peak (model FLOP utilization).
    flops: StepFlops | None = None

    @property
    def mfu(self) -> float | None:
        """Model FLOP utilization of a step (None where the FLOPs could not be counted)."""
        return self.flops.mfu if self.flops is not None else None

    @property
    def top(self) -> Finding | None:
        return self.findings[0] if self.findings else None

    def remedies(self) -> list[Remedy]:
        seen: dict[str, Remedy] = {}
        for f in self.findings:
            for r in f.remedies:
                seen.setdefault(r.option, r)
        return list(seen.values())

    def apply(self, *, steps: int | None = None, progress: Progress | None = None,
              **options: Any) -> BeforeAfter:
        """Run ``optimize`` with the options the findings name (those this build has), wrap
        the loader in ``prefetch`` when data loading is a cause, and diagnose again.

        Args:
            steps: steps of the workload to run after (default: as many as before).
            progress: wraps long loops, e.g. ``tqdm``-like ``lambda it, desc: ...``.
            **options: more ``optimize`` options, e.g. ``verify=False``.
        """
        if self.workload is None:
            raise ConfigError("this Diagnosis holds no workload to re-run (it was loaded or "
                              "copied); call autoopt.diagnose again")
        from ..config import OptimizeConfig

        known = {f.name for f in dataclasses.fields(OptimizeConfig)}
        kwargs: dict[str, Any] = {}
        notes = []
        for remedy in self.remedies():
            usable = {k: v for k, v in remedy.optimize_kwargs.items() if k in known}
            kwargs.update(usable)
            if remedy.optimize_kwargs and not usable:
                notes.append(f"{remedy.option}: not available in this autoopt build")
        remedies = sorted(set(kwargs) - set(options))
        kwargs.update(options)
        try:
            fast, after, use_prefetch = self._run_optimized(kwargs, steps, progress)
        except ConfigError as exc:
            if not remedies:
                raise  # the user's own options
            # A remedy that cannot apply to this model (a memory budget or a precision on a
            # model only Dynamo captures) raises rather than being ignored: run without it.
            notes.append(f"{', '.join(f'{k}={kwargs[k]!r}' for k in remedies)}: not "
                         f"applied: {exc}")
            remedies = []
            fast, after, use_prefetch = self._run_optimized(dict(options), steps, progress)
        if remedies and after.step.total_s > self.step.total_s:
            # A remedy named from evidence can still lose here (casts around kept-fp32 ops
            # outweighing faster matmuls, say): measure without the options it added, and
            # keep whichever runs faster.
            plain_fast, plain_after, plain_prefetch = self._run_optimized(
                dict(options), steps, progress)
            if plain_after.step.total_s < after.step.total_s:
                notes.append(f"{', '.join(f'{k}={kwargs[k]!r}' for k in remedies)}: step "
                             f"{after.step.total_s * 1e3:.2f} ms with, "
                             f"{plain_after.step.total_s * 1e3:.2f} ms without; not applied")
                fast, after, use_prefetch = plain_fast, plain_after, plain_prefetch
                remedies = []
        # An option optimize accepted but did not apply (precision found no op it could
        # cast, or that would be faster) is not credited with the speedup.
        warnings = getattr(getattr(fast, "report", None), "warnings", [])
        for option in list(remedies):
            refused = [w for w in warnings if w.startswith(f"{option}=") and "not applied" in w]
            if refused:
                remedies.remove(option)
                notes.append(refused[0])
        applied = ["fusion"] + remedies + (["prefetch"] if use_prefetch else [])
        if after.step.total_s > self.step.total_s:
            notes.append(f"the optimized module measured slower than the model "
                         f"({after.step.total_s * 1e3:.2f} ms against "
                         f"{self.step.total_s * 1e3:.2f} ms a step); keep the model as it is "
                         f"for this workload")
        return BeforeAfter(self, after, applied, notes, fast)

    def _run_optimized(self, kwargs: dict[str, Any], steps: int | None,
                       progress: Progress | None) -> tuple[nn.Module, Diagnosis, bool]:
        """``optimize`` with ``kwargs``, then the workload diagnosed on the result (through
        ``prefetch`` where data loading is a cause): the module, its diagnosis, and whether
        prefetch was used."""
        from ..build import build as optimize

        w = self.workload
        assert w is not None
        args, ex_kwargs = w.example()
        for _ in (progress or (lambda it, desc: it))([0], "optimize (capture, passes, "
                                                          "verification)"):
            fast = optimize(w.model, args, ex_kwargs, training=self.training, **kwargs)
        use_prefetch = any(f.cause == "data" for f in self.findings) and w.is_loader
        source: Any = w.source
        if use_prefetch:
            from ..runtime.prefetch import prefetch

            source = prefetch(w.source, w.device, depth=2)
        try:
            after = diagnose(fast, source, training=self.training, steps=steps or self.steps,
                             device=w.device, unpack=w.unpack, loss_fn=w.loss_fn,
                             interval_s=self.utilization.interval_s, progress=progress)
        finally:
            if use_prefetch:
                source.close()
        return fast, after, use_prefetch

    def __str__(self) -> str:
        s = self.step
        lines = [f"autoopt diagnosis ({'training' if self.training else 'inference'} on "
                 f"{self.device}, {self.steps} steps, batch {self.batch_size or '?'})",
                 f"step {s.total_s * 1e3:.2f} ms: data {s.data_s * 1e3:.2f} ms, transfer "
                 f"{s.transfer_s * 1e3:.2f} ms, compute {s.compute_s * 1e3:.2f} ms",
                 self.utilization.summary()]
        if self.flops is not None:
            lines.append(self.flops.line())
        lines.append("")
        lines += [str(f) for f in self.findings] or ["no cause above 1% of step time"]
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)


@dataclass
class BeforeAfter:
    """``Diagnosis.apply``'s result: the diagnosis before and after, and what was applied."""

    before: Diagnosis
    after: Diagnosis
    applied: list[str]
    notes: list[str]
    optimized: nn.Module

    @property
    def speedup(self) -> float:
        return self.before.step.total_s / self.after.step.total_s

    def __str__(self) -> str:
        b, a = self.before, self.after
        util_b = b.utilization.mean("gpu_percent") if b.utilization.has_gpu else \
            b.utilization.mean("process_cpu_percent")
        util_a = a.utilization.mean("gpu_percent") if a.utilization.has_gpu else \
            a.utilization.mean("process_cpu_percent")
        what = "GPU SM" if b.utilization.has_gpu else "process CPU"
        lines = [f"applied: {', '.join(self.applied)}",
                 f"step time: {b.step.total_s * 1e3:.2f} ms -> {a.step.total_s * 1e3:.2f} ms "
                 f"({self.speedup:.2f}x)",
                 f"{what} utilization: {util_b or 0:.0f}% -> {util_a or 0:.0f}%"]
        lines += [f"note: {n}" for n in self.notes]
        lines += ["", "after:", str(a)]
        return "\n".join(lines)


def diagnose(model: nn.Module, data: Any, example_kwargs: Mapping[str, Any] | None = None, *,
             training: bool = False, steps: int = 10, warmup: int = 2, profile_steps: int = 2,
             device: str | torch.device | None = None,
             unpack: Callable[[Any], tuple[tuple[Any, ...], dict[str, Any]]] | None = None,
             loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
             interval_s: float = 0.05, roofline: bool = True,
             progress: Progress | None = None) -> Diagnosis:
    """Run ``model`` on ``data`` and say why the device is not busier.

    Your model object is not modified: the workload runs on a copy (a model that cannot be
    copied runs itself, and gets its modes, gradients, buffers and attributes back).

    Args:
        model: the module to run.
        data: example inputs (a tensor or a tuple of positional inputs), run again each step;
            or an iterable of batches (a ``DataLoader``), read as the steps go.
        example_kwargs: keyword inputs, with example inputs.
        training: run forward and backward (the loss is ``loss_fn(output, batch)``, by default
            the mean of the output's floating tensors) instead of inference.
        steps: timed steps (after ``warmup`` untimed ones).
        warmup: steps run first and not counted (allocation, autotuning).
        profile_steps: steps run under ``torch.profiler`` for the per-op breakdown.
        device: where to run; default: where the model's parameters are.
        unpack: a batch -> ``(args, kwargs)``; default: a tensor is one input, a dict is keyword
            inputs, a tuple/list is ``(inputs, target, ...)`` whose first element is the input.
        loss_fn: ``(output, batch) -> scalar`` when training.
        interval_s: seconds between utilization samples.
        roofline: label ops with the cost model (profiles each graph node once).
        progress: wraps long loops with a progress bar, ``(iterable, description)``.

    Returns:
        A ``Diagnosis``; ``print`` it, or ``diagnosis.apply()`` to try the fixes.
    """
    if not isinstance(model, nn.Module):
        raise ModelError(f"diagnose expects a torch.nn.Module; got {type(model).__name__}")
    if not isinstance(steps, int) or steps < 1:
        raise ConfigError(f"diagnose steps must be an integer >= 1; got {steps!r}")
    if not isinstance(warmup, int) or warmup < 0 or not isinstance(profile_steps, int) \
            or profile_steps < 0:
        raise ConfigError("diagnose warmup and profile_steps must be integers >= 0")
    progress = progress or (lambda it, desc: it)
    workload = Workload(model, data, example_kwargs, device, training, unpack, loss_fn)
    timings: list[tuple[float, float, float, float]] = []
    process_cpu = 0.0
    batches = workload.batches()
    if workload.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(workload.device)  # peak memory of this run only
    with workload.running():
        try:
            for _ in progress(range(warmup), "warm-up"):
                workload.step(batches)
            with UtilizationSampler(interval_s, gpu_index=workload.gpu_index) as sampler:
                for _ in progress(range(steps), "timed steps"):
                    times = workload.step(batches)
                    timings.append(times[:4])
                    process_cpu += times[4]
            ops, launches = profile_ops(workload, batches, profile_steps, progress)
        finally:
            batches.close()
        cost = roofline_cost(workload, progress) if roofline else None
        flops = step_flops(workload, statistics.median(t[3] for t in timings))
    diagnosis = _attribute(workload, timings, process_cpu, sampler.result, ops, launches, cost,
                           steps)
    diagnosis.flops = flops
    if flops is not None:
        diagnosis.notes.extend(flops.notes)
    return diagnosis


def _attribute(w: Workload, timings: list[tuple[float, float, float, float]],
               process_cpu: float, util: Utilization, ops: list[OpTime],
               launches: dict[str, float], cost: GraphCost | None, steps: int) -> Diagnosis:
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
    findings = find_causes(shares, **context)
    batch = batch_size(w)
    return Diagnosis(findings, median, shares, str(w.device), w.training, steps, batch, util,
                     ops, cost, notes, w)


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
