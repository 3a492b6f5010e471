"""What the HTML report shows, measured: optimize the model (unless given the result),
diagnose the model and the optimized module, and time both interleaved.

    data = collect(model, (x,), {}, optimized=fast)     # measures before/after, diagnoses
    write_report("report.html", data)                   # autoopt.diagnose.render
"""

from __future__ import annotations

import copy
import datetime
import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from autoopt.check.report import Report
from autoopt.check.state import preserved
from autoopt.diagnose.diagnosis import Diagnosis, diagnose
from autoopt.diagnose.workload import Progress


@dataclass
class ReportData:
    """Everything the HTML report shows; any part may be missing.

    Args:
        title: the heading, usually the model's name.
        device: where it ran.
        latency_s: label -> median seconds per call (``eager``, ``autoopt``), measured
            interleaved in one run.
        before, after: diagnoses of the original and the optimized module.
        optimized: the module ``optimize`` returned (its ``report`` lists the passes).
        report: the optimize report, when no module is at hand.
    """

    title: str
    device: str = "cpu"
    threads: int = field(default_factory=torch.get_num_threads)
    latency_s: dict[str, float] = field(default_factory=dict)
    before: Diagnosis | None = None
    after: Diagnosis | None = None
    optimized: nn.Module | None = None
    report: Report | None = None
    created: str = field(default_factory=lambda: datetime.datetime.now(datetime.timezone.utc)
                         .strftime("%Y-%m-%d %H:%M UTC"))


def collect(model: nn.Module, args: tuple[Any, ...], kwargs: Mapping[str, Any] | None = None,
            *, optimized: nn.Module | None = None, training: bool = False, steps: int = 10,
            repeats: int = 15, title: str | None = None, interval_s: float = 0.02,
            progress: Progress | None = None, **options: Any) -> ReportData:
    """Optimize ``model`` (unless ``optimized`` is given), diagnose both, time both.

    Args:
        model: the original module (not modified).
        args, kwargs: example inputs.
        optimized: the result of ``optimize``; made with ``options`` when None.
        training: diagnose training steps (forward and backward).
        steps: diagnosis steps for each module.
        repeats: interleaved timed calls of each module for the latency chart.
        title: the heading (default: the model's class name).
        interval_s: seconds between utilization samples.
        progress: wraps long loops, ``(iterable, description) -> iterable``.
        **options: ``optimize`` options.
    """
    from autoopt.module.build import build as optimize

    kwargs = dict(kwargs or {})
    progress = progress or (lambda it, desc: it)
    if optimized is None:
        for _ in progress([0], "optimize (capture, passes, verification)"):
            optimized = optimize(model, args, kwargs, training=training, **options)
    device = next((t.device for t in _tensors((args, kwargs))), None)
    before = diagnose(model, args, kwargs, training=training, steps=steps, device=device,
                      interval_s=interval_s, progress=progress)
    after = diagnose(optimized, args, kwargs, training=training, steps=steps, device=device,
                     interval_s=interval_s, progress=progress)
    # Timed on copies: a training-mode call updates BatchNorm statistics, and neither the
    # user's model nor the returned module may change. One that cannot be copied runs in
    # place and is restored.
    in_place: list[nn.Module] = []
    eager, fast = _copy_or_keep(model, in_place), _copy_or_keep(optimized, in_place)
    if device is not None and eager is not model:
        eager.to(device)
    modes = [(m, m.training) for held in in_place for m in held.modules()]
    try:
        with preserved(*in_place):
            eager.train(training)
            fast.train(training)
            latency = interleaved_latency({"eager": eager, "autoopt": fast}, args, kwargs,
                                          repeats, training, progress)
    finally:
        for m, mode in modes:
            m.training = mode
    return ReportData(title or type(model).__name__, before.device, latency_s=latency,
                      before=before, after=after, optimized=optimized,
                      report=getattr(optimized, "report", None))


def _copy_or_keep(module: nn.Module, in_place: list[nn.Module]) -> nn.Module:
    try:
        return copy.deepcopy(module)
    except Exception:  # noqa: BLE001 - e.g. a lock inside: time it in place, restore after
        in_place.append(module)
        return module


def interleaved_latency(modules: Mapping[str, Callable[..., Any]], args: tuple[Any, ...],
                        kwargs: Mapping[str, Any], repeats: int = 15, training: bool = False,
                        progress: Progress | None = None) -> dict[str, float]:
    """Median seconds per call of each module, called in turn so drift hits all alike."""
    progress = progress or (lambda it, desc: it)
    devices = {t.device for t in _tensors((args, kwargs))}
    cuda = any(d.type == "cuda" for d in devices)
    samples: dict[str, list[float]] = {name: [] for name in modules}
    grad = torch.enable_grad() if training else torch.no_grad()
    with grad:
        for fn in modules.values():  # warm-up
            fn(*args, **kwargs)
        for _ in progress(range(repeats), "benchmark before/after"):
            for name, fn in modules.items():
                if cuda:
                    torch.cuda.synchronize()
                start = time.perf_counter()
                fn(*args, **kwargs)
                if cuda:
                    torch.cuda.synchronize()
                samples[name].append(time.perf_counter() - start)
    return {name: statistics.median(s) for name, s in samples.items()}


def _tensors(value: Any) -> list[torch.Tensor]:
    from torch.utils import _pytree as pytree

    return [t for t in pytree.tree_leaves(value) if isinstance(t, torch.Tensor)]
