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

import contextlib
import copy
import dataclasses
import logging
import statistics
import time
from collections import Counter
from collections.abc import Callable, Generator, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from ..cost_model import CostModel, GraphCost, device_info
from ..errors import ConfigError, InputError, ModelError
from .sampler import Utilization, UtilizationSampler

log = logging.getLogger(__name__)

Progress = Callable[[Iterable[Any], str], Iterable[Any]]
CAUSES = ("data", "memory", "operators", "parallelism")
# Findings below this share of step time are not worth a line.
_MIN_SHARE = 0.01
_CAPACITY_WARNING = 0.85
# An op is launch/dispatch-bound when its roofline work is under this share of its time and
# it lasts under this many per-op overheads (longer ops that slow are inefficient kernels).
_OVERHEAD_WORK = 0.25
_SHORT_OPS = 50
# On a CPU: the process got under this share of its threads while the cores were this busy
# (percent): other processes held the CPU.
_CONTENDED_BUSY = 0.9
_CONTENDED_CPU = 85.0


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


@dataclass(frozen=True)
class OpTime:
    """One op's time per step in the profiled run (``torch.profiler``: the op as the model
    called it, with the time of the ops and kernels beneath it)."""

    name: str
    calls: float
    seconds: float
    bound: str = ""


@dataclass(frozen=True)
class StepTimes:
    """Median seconds per step, by phase."""

    data_s: float
    transfer_s: float
    compute_s: float
    total_s: float


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
    workload: _Workload | None = field(default=None, repr=False)

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
        fast, after, use_prefetch = self._run_optimized(kwargs, steps, progress)
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
                 self.utilization.summary(), ""]
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
    workload = _Workload(model, data, example_kwargs, device, training, unpack, loss_fn)
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
            ops, launches = _profile_ops(workload, batches, profile_steps, progress)
        finally:
            batches.close()
        cost = _roofline(workload, progress) if roofline else None
    return _attribute(workload, timings, process_cpu, sampler.result, ops, launches, cost,
                      steps)


class _Workload:
    """The model (a private copy), where its batches come from, and one timed step."""

    def __init__(self, model: nn.Module, data: Any, example_kwargs: Mapping[str, Any] | None,
                 device: str | torch.device | None, training: bool,
                 unpack: Callable[[Any], tuple[tuple[Any, ...], dict[str, Any]]] | None,
                 loss_fn: Callable[[Any, Any], torch.Tensor] | None) -> None:
        params = list(model.parameters()) + list(model.buffers())
        self.device = torch.device(device) if device is not None else (
            params[0].device if params else torch.device("cpu"))
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ConfigError(f"diagnose device={device!r} asks for CUDA but no CUDA GPU is "
                              "available; use device='cpu'")
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        try:
            self.model = copy.deepcopy(model)
            self.copied = True
        except Exception as exc:  # noqa: BLE001 - e.g. a lock inside: run it and undo after
            log.info("diagnose cannot copy the model (%s); running it in place", exc)
            self.model, self.copied = model, False
        if params and params[0].device != self.device:
            if not self.copied:
                raise ModelError(f"diagnose would move the model to {self.device}, but it "
                                 f"cannot be copied and yours must not change; move it (and "
                                 f"its inputs) to {self.device} first")
            # Only when needed: moving an OptimizedModule drops its captured graphs.
            self.model.to(self.device)
        self.training = training
        self.loss_fn = loss_fn
        self.unpack = unpack or _default_unpack
        self.is_loader = not isinstance(data, (torch.Tensor, tuple))
        if self.is_loader and not isinstance(data, Iterable):
            raise InputError(f"diagnose data must be example inputs (a tensor or a tuple) or an "
                             f"iterable of batches (a DataLoader); got {type(data).__name__}")
        if self.is_loader and example_kwargs:
            raise InputError("example_kwargs go with example inputs, not with a DataLoader; "
                             "return keyword inputs from the batches (a dict) or use unpack=")
        self.source = data
        if not self.is_loader:
            inputs = (data,) if isinstance(data, torch.Tensor) else data
            self._example = self._to_device((inputs, dict(example_kwargs or {})))
        self.gpu_index = (self.device.index or 0) if self.device.type == "cuda" else None
        self.first_batch: Any = None

    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        """Set the train/eval mode for the run; a model run in place (not copied) gets its
        modes, gradients, buffers, Python attributes and RNG back afterwards."""
        if self.copied:
            self.model.train(self.training)
            yield
            return
        from ..state import preserved

        modes = [(m, m.training) for m in self.model.modules()]
        grads = [(p, p.grad) for p in self.model.parameters()]
        try:
            with preserved(self.model):
                self.model.train(self.training)
                yield
        finally:
            for m, mode in modes:
                m.training = mode
            for p, grad in grads:
                p.grad = grad

    def example(self) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """One batch's inputs on the device (for capture and the roofline)."""
        if not self.is_loader:
            return self._example
        batch = self.first_batch if self.first_batch is not None else next(iter(self.source))
        return self._to_device(self.unpack(batch))

    def batches(self) -> Generator[Any, None, None]:
        """Batches forever: the example again and again, or the loader pass after pass."""
        if not self.is_loader:
            while True:
                yield None
        while True:
            empty = True
            it = iter(self.source)
            try:
                for batch in it:
                    empty = False
                    if self.first_batch is None:
                        self.first_batch = batch
                    yield batch
            finally:
                close = getattr(it, "close", None)  # a prefetch pass: end its thread now
                if callable(close):
                    close()
            if empty:
                raise InputError("diagnose's DataLoader yielded no batches")

    def step(self, batches: Iterator[Any]) -> tuple[float, float, float, float, float]:
        """One step; returns (data, transfer, compute, total, process CPU during compute)."""
        start = time.perf_counter()
        batch = next(batches)
        loaded = time.perf_counter()
        if self.is_loader:
            batch = self._to_device(batch)  # the loss sees the batch where the model runs
            args, kwargs = self.unpack(batch)
        else:
            args, kwargs = self._example
        self._sync()
        copied = time.perf_counter()
        cpu_before = _process_seconds()
        with torch.no_grad() if not self.training else contextlib.nullcontext():
            out = self.model(*args, **kwargs)
            if self.training:
                loss = self.loss_fn(out, batch) if self.loss_fn else _default_loss(out)
                loss.backward()
                self.model.zero_grad(set_to_none=True)
        self._sync()
        done = time.perf_counter()
        return (loaded - start, copied - loaded, done - copied, done - start,
                _process_seconds() - cpu_before)

    def _to_device(self, value: Any) -> Any:
        return pytree.tree_map_only(torch.Tensor,
                                    lambda t: t.to(self.device, non_blocking=True), value)

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def _default_unpack(batch: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    if isinstance(batch, Mapping):
        return (), dict(batch)
    if isinstance(batch, (tuple, list)):
        return (batch[0],), {}
    return (batch,), {}


def _default_loss(out: Any) -> torch.Tensor:
    leaves = [t for t in pytree.tree_leaves(out)
              if isinstance(t, torch.Tensor) and t.is_floating_point() and t.requires_grad]
    if not leaves:
        raise ModelError("training=True but the model's output has no floating tensor that "
                         "requires grad; pass loss_fn=(output, batch) -> scalar")
    return sum(t.float().mean() for t in leaves)  # type: ignore[return-value]


def _process_seconds() -> float:
    return time.process_time()


def _profile_ops(w: _Workload, batches: Iterator[Any], steps: int, progress: Progress,
                 ) -> tuple[list[OpTime], dict[str, float]]:
    """Per-op time per step (inclusive of the kernels beneath), and launch counts, from
    ``torch.profiler``."""
    if steps == 0:
        return [], {}
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if w.device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities) as prof:
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


def _roofline(w: _Workload, progress: Progress) -> GraphCost | None:
    """The cost model's per-node profile of the model's graph, or None if it has none."""
    from ..capture.graph import export_graph, flat_example_inputs
    from ..module import OptimizedModule

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


def _attribute(w: _Workload, timings: list[tuple[float, float, float, float]],
               process_cpu: float, util: Utilization, ops: list[OpTime],
               launches: dict[str, float], cost: GraphCost | None, steps: int) -> Diagnosis:
    """Split step time into the four causes and write a finding for each that matters."""
    data, transfer, compute, total = (sum(col) for col in zip(*timings, strict=True))
    median = StepTimes(*(statistics.median(col) for col in zip(*timings, strict=True)))
    notes: list[str] = []
    fractions = {"compute": 1.0, "memory": 0.0, "overhead": 0.0}
    labels: dict[str, str] = {}
    if cost is not None and cost.latency_s > 0:
        labels = _labels(cost, w.device)
        by_bound = Counter[str]()
        for c in cost.nodes:
            by_bound[labels[c.node]] += c.latency_s
        fractions = {b: by_bound[b] / cost.latency_s for b in ("compute", "memory", "overhead")}
        bounds = _bound_by_op(cost, labels)
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
    findings = []
    for cause in CAUSES:
        finding = _FINDERS[cause](shares[cause], **context)
        if finding is not None:
            findings.append(finding)
    findings.sort(key=lambda f: -f.share)
    batch = _batch_size(w)
    return Diagnosis(findings, median, shares, str(w.device), w.training, steps, batch, util,
                     ops, cost, notes, w)


def _busy_fraction(w: _Workload, process_cpu: float, compute: float,
                   launches: dict[str, float], steps: int) -> float:
    """Share of the compute phase the device was working: kernel time on a GPU, the
    process's CPU time over the intra-op threads on a CPU."""
    if compute <= 0:
        return 1.0
    if w.device.type == "cuda":
        per_step = compute / steps
        return min(1.0, launches.get("kernel_s", 0.0) / per_step) if launches else 1.0
    return min(1.0, process_cpu / compute / torch.get_num_threads())


def _labels(cost: GraphCost, device: torch.device) -> dict[str, str]:
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


def _bound_by_op(cost: GraphCost, labels: dict[str, str]) -> dict[str, str]:
    """``aten::addmm`` -> the limit that holds most of its time in the cost profile."""
    seconds: dict[str, Counter[str]] = {}
    for c in cost.nodes:
        if c.op.startswith("aten."):
            name = "aten::" + c.op.split(".")[1]
            seconds.setdefault(name, Counter())[labels[c.node]] += c.latency_s
    return {name: counts.most_common(1)[0][0] for name, counts in seconds.items()}


def _batch_size(w: _Workload) -> int | None:
    try:
        args, kwargs = w.example()
    except Exception:  # noqa: BLE001 - a loader that cannot restart has no known batch size
        return None
    for t in pytree.tree_leaves((args, kwargs)):
        if isinstance(t, torch.Tensor) and t.dim() > 0:
            return int(t.shape[0])
    return None


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f} ms"


def _data_finding(share: float, *, w: _Workload, median: StepTimes, launches: dict[str, float],
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


def _memory_finding(share: float, *, w: _Workload, util: Utilization, cost: GraphCost | None,
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


def _operators_finding(share: float, *, w: _Workload, launches: dict[str, float],
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


def _parallelism_finding(share: float, *, w: _Workload, busy: float, util: Utilization,
                         **_: Any) -> Finding | None:
    if share < _MIN_SHARE:
        return None
    batch = _batch_size(w)
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


def _memory_use(w: _Workload) -> tuple[int, int]:
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


# --- the ``autoopt diagnose`` command -----------------------------------------------------

def console_progress(iterable: Iterable[Any], description: str) -> Iterable[Any]:
    """A ``tqdm`` progress bar on stderr (shown on a terminal only), or the iterable as is."""
    try:
        from tqdm import tqdm
    except ImportError:
        return iterable
    return tqdm(iterable, desc=description, leave=False, disable=None)


def load_batches(spec: str) -> Iterable[Any]:
    """``package.module:name`` or ``path/to/file.py:name`` -> an iterable of batches (``name``
    is called with no arguments when it is a function, e.g. one that builds a DataLoader)."""
    import importlib
    import importlib.util
    from pathlib import Path

    from ..errors import ModelSpecError

    if ":" not in spec:
        raise ModelSpecError(f"--loader {spec!r} must be 'package.module:name' or "
                             "'path/to/file.py:name'")
    where, name = spec.rsplit(":", 1)
    try:
        if where.endswith(".py"):
            found = importlib.util.spec_from_file_location(f"_autoopt_loader_{Path(where).stem}",
                                                           where)
            if found is None or found.loader is None or not Path(where).is_file():
                raise ModelSpecError(f"--loader {spec!r}: no such Python file {where!r}")
            source = importlib.util.module_from_spec(found)
            found.loader.exec_module(source)
        else:
            source = importlib.import_module(where)
        target = getattr(source, name)
        batches = target() if callable(target) and not isinstance(target, Iterable) else target
    except ModelSpecError:
        raise
    except Exception as exc:
        raise ModelSpecError(f"--loader {spec!r} could not be loaded: {type(exc).__name__}: "
                             f"{exc}") from exc
    if not isinstance(batches, Iterable):
        raise ModelSpecError(f"--loader {spec!r} gave {type(batches).__name__}, not an "
                             "iterable of batches (a DataLoader)")
    return batches
