"""Why the device is idle: run a workload, measure it, and name the causes with their evidence.

    diagnosis = autoopt.diagnose(model, loader, training=True, steps=20, optimizer=opt)
    print(diagnosis)                 # findings ranked by share of step time, each with a fix
    result = diagnosis.apply()       # optimize with those fixes; before/after step time
    result.optimized, result.optimizer   # the module, and a new optimizer for it

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

``apply`` then tries the whole-step remedies (``whole_step``: the optimizer's update fused; on
CUDA TF32, cuDNN benchmark and a CUDA graph of the whole step), each timed against the step
without it, kept only where faster, and reported either way.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import statistics
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from autoopt.cost_model import GraphCost
from autoopt.diagnose.attribution import attribute
from autoopt.diagnose.findings import Finding, Remedy
from autoopt.diagnose.mfu import StepFlops, step_flops
from autoopt.diagnose.per_op import OpTime, profile_ops, roofline_cost
from autoopt.diagnose.sampler import Utilization, UtilizationSampler
from autoopt.diagnose.whole_step import StepOptions, copy_optimizer, fused_overrides, settings_off
from autoopt.diagnose.workload import Progress, StepTimes, Workload, batch_size
from autoopt.errors import ConfigError, ModelError
from autoopt.observe import progress as progress_lines

log = logging.getLogger(__name__)

# On a CPU: the process got under this share of its threads while the cores were this busy
# (percent): other processes held the CPU.


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
        the loader in ``prefetch`` when data loading is a cause, try the whole-step remedies
        (the optimizer's update fused; on CUDA TF32, cuDNN benchmark, a CUDA graph of the
        step), and diagnose again.

        Each remedy is kept only where its measured step is faster; every one tried is a
        note with its times. Your model and optimizer are not changed: the result holds a new
        module (``optimized``) and, with ``diagnose(..., optimizer=)``, a new optimizer of
        the same class over its parameters (``optimizer``: your hyperparameters and state as
        they were at ``diagnose``, ``fused=True`` where that was kept).

        Args:
            steps: steps of the workload to run after (default: as many as before).
            progress: wraps long loops, e.g. ``tqdm``-like ``lambda it, desc: ...``.
            **options: more ``optimize`` options, e.g. ``verify=False``.
        """
        if self.workload is None:
            raise ConfigError("this Diagnosis holds no workload to re-run (it was loaded or "
                              "copied); call autoopt.diagnose again")
        with progress_lines.reported("Diagnosis.apply"):  # minutes: optimize, diagnose again
            return self._apply(steps, _logged(progress), options)

    def _apply(self, steps: int | None, progress: Progress, options: dict[str, Any],
               ) -> BeforeAfter:
        from autoopt.options.config import OptimizeConfig

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
        kept, optimizer, step_notes = self._whole_step(fast, steps)
        notes += step_notes
        if kept != StepOptions():
            after = self._diagnose_optimized(fast, steps, progress, use_prefetch, kept)
            applied += _names(kept)
        if after.step.total_s > self.step.total_s:
            notes.append(f"the optimized module measured slower than the model "
                         f"({after.step.total_s * 1e3:.2f} ms against "
                         f"{self.step.total_s * 1e3:.2f} ms a step); keep the model as it is "
                         f"for this workload")
        return BeforeAfter(self, after, applied, notes, fast, optimizer, kept)

    def _start(self) -> tuple[nn.Module, torch.optim.Optimizer | None]:
        """The model (and optimizer) as they were before the diagnosis's steps moved them."""
        w = self.workload
        assert w is not None
        return w.start if w.start is not None else (w.model, w.optimizer)

    def _optimizer_for(self, fast: nn.Module, **overrides: Any,
                       ) -> torch.optim.Optimizer | None:
        """A copy of the optimizer at its start, over ``fast``'s parameters."""
        model, optimizer = self._start()
        return copy_optimizer(optimizer, model, fast, **overrides) if optimizer else None

    def _run_optimized(self, kwargs: dict[str, Any], steps: int | None,
                       progress: Progress | None) -> tuple[nn.Module, Diagnosis, bool]:
        """``optimize`` with ``kwargs``, then the workload diagnosed on the result (through
        ``prefetch`` where data loading is a cause): the module, its diagnosis, and whether
        prefetch was used."""
        from autoopt.module.build import build as optimize

        w = self.workload
        assert w is not None
        args, ex_kwargs = w.example()
        for _ in (progress or (lambda it, desc: it))([0], "optimize (capture, passes, "
                                                          "verification)"):
            fast = optimize(self._start()[0], args, ex_kwargs, training=self.training,
                            **kwargs)
        use_prefetch = any(f.cause == "data" for f in self.findings) and w.is_loader
        after = self._diagnose_optimized(fast, steps, progress, use_prefetch, StepOptions())
        return fast, after, use_prefetch

    def _diagnose_optimized(self, fast: nn.Module, steps: int | None,
                            progress: Progress | None, use_prefetch: bool,
                            options: StepOptions) -> Diagnosis:
        """The workload diagnosed on ``fast`` run with ``options`` (through ``prefetch`` when
        ``use_prefetch``)."""
        w = self.workload
        assert w is not None
        source: Any = w.source
        if use_prefetch:
            from autoopt.runtime.prefetch import prefetch

            source = prefetch(w.source, w.device, depth=2)
        try:
            # Example inputs given as keywords go with the data as they did the first time.
            kwargs = None if w.is_loader else w.example()[1] or None
            return diagnose(fast, source, kwargs, training=self.training,
                            steps=steps or self.steps,
                            device=w.device, unpack=w.unpack, loss_fn=w.loss_fn,
                            interval_s=self.utilization.interval_s, progress=progress,
                            roofline=self.cost is not None,  # as before: roofline=False holds
                            optimizer=self._optimizer_for(fast), step_options=options)
        finally:
            if use_prefetch:
                source.close()

    def _whole_step(self, fast: nn.Module, steps: int | None,
                    ) -> tuple[StepOptions, torch.optim.Optimizer | None, list[str]]:
        """Try each whole-step remedy on ``fast`` against the step without it (interleaved
        steps, median compute time), keeping those that are faster: the options kept, a new
        optimizer over ``fast``'s parameters with them, and a note for each remedy."""
        w = self.workload
        assert w is not None
        notes: list[str] = []
        candidates: list[tuple[str, dict[str, Any], str]] = []  # (remedy, options, how)
        optimizer = self._optimizer_for(fast)
        if optimizer is not None:
            overrides, what = fused_overrides(optimizer, fast)
            if overrides:
                candidates.append(("fused optimizer", {"optimizer": what},
                                   f"{type(optimizer).__name__}(..., {what}=True)"))
            else:
                notes.append(f"fused optimizer: not tried: {what}")
        elif self.training:
            notes.append("fused optimizer: not tried: no optimizer (diagnose(..., "
                         "optimizer=opt) runs its update in each step)")
        if w.device.type != "cuda":
            notes.append(f"TF32, cuDNN benchmark, CUDA graph of the step: not tried: CUDA "
                         f"only (this step runs on {w.device.type})")
        else:
            candidates += self._cuda_candidates(notes)
        kept = StepOptions()
        for remedy, change, how in candidates:
            log.info("timing the step with and without the %s", remedy)
            trial = dataclasses.replace(kept, **change)
            try:
                without, with_ = self._time_options(fast, kept, trial, steps)
            except Exception as exc:  # noqa: BLE001 - a remedy that cannot run is reported
                text = str(exc).strip().splitlines()
                notes.append(f"{remedy} ({how}): not applied: {type(exc).__name__}: "
                             f"{text[0][:200] if text else ''}")
                continue
            faster = with_ < without
            notes.append(f"{remedy} ({how}): step {with_ * 1e3:.2f} ms with, "
                         f"{without * 1e3:.2f} ms without (compute, median); "
                         + ("kept" if faster else "not kept"))
            if faster:
                kept = trial
        if optimizer is not None and kept.optimizer:
            optimizer = self._optimizer_for(fast, **fused_overrides(optimizer, fast)[0])
        return kept, optimizer, notes

    def _cuda_candidates(self, notes: list[str]) -> list[tuple[str, dict[str, Any], str]]:
        """The CUDA whole-step remedies that apply to this step; why not for the others."""
        w = self.workload
        assert w is not None
        off = settings_off(w.device)
        candidates = []
        fp32 = self.flops is None or self.flops.by_dtype.get("float32", 0) > 0
        varied = f"the input shapes varied ({len(w.shapes)} seen)"
        if "tf32" not in off:
            notes.append("TF32: not tried: on already in this process")
        elif not fp32:
            notes.append("TF32: not tried: the step runs no fp32 matmul or convolution")
        else:
            candidates.append(("TF32", {"tf32": True}, "torch.backends.cuda.matmul."
                               "fp32_precision = torch.backends.cudnn.conv.fp32_precision = "
                               "'tf32' (older torch: allow_tf32 = True), process-wide; set "
                               "for the diagnosis's steps only"))
        if "cudnn_benchmark" not in off:
            notes.append("cuDNN benchmark: not tried: on already in this process")
        elif not w.static_shapes:
            notes.append(f"cuDNN benchmark: not tried: {varied}")
        else:
            candidates.append(("cuDNN benchmark", {"cudnn_benchmark": True},
                               "torch.backends.cudnn.benchmark = True, process-wide; set for "
                               "the diagnosis's steps only"))
        if not self.training:
            notes.append("CUDA graph of the step: not tried: for training steps (optimize "
                         "records inference graphs itself)")
        elif not w.static_shapes:
            notes.append(f"CUDA graph of the step: not tried: {varied}")
        else:
            candidates.append(("CUDA graph of the step", {"cuda_graph": True},
                               "forward, loss, backward and the optimizer's update recorded "
                               "once with torch.cuda.graph and replayed"))
        return candidates

    def _time_options(self, fast: nn.Module, base: StepOptions, trial: StepOptions,
                      steps: int | None) -> tuple[float, float]:
        """Median compute seconds of a step of ``fast`` run with ``base`` and with ``trial``,
        on two copies, their steps interleaved (after two warm-up steps each)."""
        w = self.workload
        assert w is not None
        data, kwargs = (w.source, None) if w.is_loader else w.example()
        runs = [Workload(fast, data, kwargs, w.device, self.training, w.unpack, w.loss_fn,
                         optimizer=self._optimizer_for(fast), options=options)
                for options in (base, trial)]
        samples: list[list[float]] = [[], []]
        with contextlib.ExitStack() as stack:
            feeds = [stack.enter_context(contextlib.closing(r.batches())) for r in runs]
            for r in runs:
                stack.enter_context(r.running())
            for i in range(2 + max(3, steps or self.steps)):
                for k, (r, feed) in enumerate(zip(runs, feeds, strict=True)):
                    compute_s = r.step(feed)[2]
                    if i >= 2:
                        samples[k].append(compute_s)
        if runs[1].graph_misses:
            raise RuntimeError(f"{runs[1].graph_misses} step(s) had shapes the CUDA graph was "
                               "not recorded for")
        return statistics.median(samples[0]), statistics.median(samples[1])

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
    # A new optimizer over ``optimized``'s parameters (diagnose(..., optimizer=) only): your
    # optimizer's class, hyperparameters and state, fused where that was kept.
    optimizer: torch.optim.Optimizer | None = None
    # The whole-step remedies kept (how ``after``'s steps ran around the module).
    step_options: StepOptions = field(default_factory=StepOptions)

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


@progress_lines.reporting("diagnose")
def diagnose(model: nn.Module, data: Any, example_kwargs: Mapping[str, Any] | None = None, *,
             training: bool = False, steps: int = 10, warmup: int = 2, profile_steps: int = 2,
             device: str | torch.device | None = None,
             unpack: Callable[[Any], tuple[tuple[Any, ...], dict[str, Any]]] | None = None,
             loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
             interval_s: float = 0.05, roofline: bool = True,
             progress: Progress | None = None,
             optimizer: torch.optim.Optimizer | None = None,
             step_options: StepOptions | None = None) -> Diagnosis:
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
        optimizer: your training's optimizer (``torch.optim``, over ``model``'s parameters):
            each training step then ends with its update, run by a copy of it over the copy
            of the model (neither of yours changes); ``apply()`` tries it fused.
        step_options: how the step runs around the model (``whole_step.StepOptions``: a
            fused optimizer, TF32, cuDNN benchmark, a CUDA graph); ``apply()`` sets them.

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
    progress = _logged(progress)
    workload = Workload(model, data, example_kwargs, device, training, unpack, loss_fn,
                        optimizer, step_options, keep_start=True)
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
    split = attribute(workload, timings, process_cpu, sampler.result, ops, launches, cost, steps)
    diagnosis = Diagnosis(split.findings, split.step, split.shares, str(workload.device),
                          workload.training, steps, batch_size(workload), sampler.result,
                          split.ops, cost, split.notes, workload)
    diagnosis.findings = _unapplied(diagnosis.findings, model, workload.source)
    diagnosis.flops = flops
    if flops is not None:
        diagnosis.notes.extend(flops.notes)
    diagnosis.notes.extend(_whole_step_notes(workload))
    return diagnosis


def _logged(progress: Progress | None) -> Progress:
    """``progress`` (or no bar) that also logs each loop's description: the step a progress
    line names where no bar is shown (piped, or called from Python)."""
    if getattr(progress, "logs", False):
        return progress  # type: ignore[return-value]
    bar = progress or (lambda iterable, description: iterable)

    def logged(iterable: Any, description: str) -> Any:
        log.info("%s", description)
        return bar(iterable, description)

    logged.logs = True  # type: ignore[attr-defined]
    return logged


def _applied(model: nn.Module, source: Any) -> dict[str, str]:
    """The remedies ``model`` (an optimized module) and ``source`` have already, each with how
    it was applied: suggesting them again (after ``apply()`` applied them) says nothing."""
    from autoopt.module.optimized import OptimizedModule
    from autoopt.runtime.prefetch import Prefetcher

    applied = {}
    if isinstance(model, OptimizedModule):
        config = model.config
        applied["fusion"] = "autoopt.optimize"
        if config.precision not in (None, "fp32"):
            applied["precision"] = f"precision={config.precision!r}"
        if config.memory_budget is not None:
            applied["offload"] = f"memory_budget={config.memory_budget!r}"
    if isinstance(source, Prefetcher):
        applied["prefetch"] = "autoopt.data.prefetch"
    return applied


def _unapplied(findings: list[Finding], model: nn.Module, source: Any) -> list[Finding]:
    """``findings`` without the remedies already applied, each finding saying which."""
    applied = _applied(model, source)
    out = []
    for finding in findings:
        # A DataLoader's own workers are a different remedy than autoopt's prefetch.
        done = [r for r in finding.remedies if r.option in applied and not (
            r.option == "prefetch" and not r.how.startswith("autoopt.data.prefetch"))]
        if not done:
            out.append(finding)
            continue
        names = ", ".join(dict.fromkeys(applied[r.option] for r in done))
        out.append(dataclasses.replace(
            finding, remedies=tuple(r for r in finding.remedies if r not in done),
            evidence=(*finding.evidence, ("applied already", names))))
    return out


def _whole_step_notes(w: Workload) -> list[str]:
    """What of the whole step runs slower than it could: the optimizer's update unfused, the
    ``torch.backends`` settings off (those the step's own options did not set)."""
    notes = []
    if w.optimizer is not None:
        overrides, what = fused_overrides(w.optimizer, w.model)
        if overrides:
            notes.append(f"the optimizer's update is not fused ({type(w.optimizer).__name__} "
                         f"without {what}=True): apply() tries it")
    names = {"tf32": "TF32 for fp32 matmuls and convolutions",
             "cudnn_benchmark": "cuDNN benchmark"}
    off = [names[o] for o in settings_off(w.device)
           if w.training and not getattr(w.options, o)]
    if off:
        notes.append(f"off in this process: {', '.join(off)}; apply() tries each")
    return notes


def _names(options: StepOptions) -> list[str]:
    """The whole-step remedies ``options`` hold, as ``applied`` lists them."""
    names = {"optimizer": f"{options.optimizer} optimizer", "tf32": "TF32",
             "cudnn_benchmark": "cuDNN benchmark", "cuda_graph": "CUDA graph of the step"}
    return [names[f.name] for f in dataclasses.fields(options) if getattr(options, f.name)]
