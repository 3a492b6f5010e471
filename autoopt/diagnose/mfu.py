"""Model FLOP utilization: the model's FLOPs per step over the step time, against the device's
peak FLOP/s in the precision the FLOPs ran in.

    MFU = Σ_dtype (FLOPs_dtype / peak_dtype) / step time

FLOPs are counted with ``torch.utils.flop_counter``'s formulas (matmuls, convolutions,
attention: what ``FlopCounterMode`` counts), forward and, in training, backward, on one step of
the model's own eager module (for an ``OptimizedModule``, ``fast.module``): the model's FLOPs,
not those of a kernel that recomputes or fuses. The peak is the cost model's measured GEMM
ceiling (``device_info().ceilings``; ``matmul_flops`` for other dtypes): what PyTorch reaches
here, not a spec sheet. A figure of 40-55% is what large bf16 training runs report on GPUs;
utilization counters (NVML's SM busy, process CPU) read far higher on steps that reach less.

MFU is never above 100%: a step faster than its FLOPs at the peaks says a peak is too low (one
measured while other processes held the cores, or a 512x512 GEMM a larger shape beats), so the
ceilings are measured again and, where the step still beats them, raised to what it reached
(``held_to_peak``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

from autoopt.cost_model.dtype_speed import matmul_flops, raise_matmul_flops
from autoopt.diagnose.workload import Workload, default_loss

log = logging.getLogger(__name__)

_SHORT = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "float64": "fp64"}


@dataclass(frozen=True)
class StepFlops:
    """One step's FLOPs and what share of the device's peak they reach.

    Args:
        forward, backward: FLOPs of the forward and of the backward (0 in inference).
        by_dtype: FLOPs per compute dtype (``bfloat16``: ops whose inputs were bf16).
        peak: the device's peak FLOP/s per dtype in ``by_dtype`` (measured GEMM ceilings).
        step_s: the median step time the figures are per.
        notes: what the figure leaves out or assumes.
    """

    forward: int
    backward: int
    by_dtype: dict[str, int]
    peak: dict[str, float]
    step_s: float
    notes: tuple[str, ...] = field(default_factory=tuple)

    @property
    def total(self) -> int:
        return self.forward + self.backward

    @property
    def achieved(self) -> float:
        """FLOP/s reached over the whole step."""
        return self.total / self.step_s if self.step_s > 0 else 0.0

    @property
    def peak_seconds(self) -> float:
        """The time the step's FLOPs take at the peak of their dtype."""
        return sum(f / self.peak[d] for d, f in self.by_dtype.items() if self.peak.get(d))

    @property
    def peak_flops(self) -> float:
        """The peak FLOP/s of the step's precision (mixed: weighted by FLOPs)."""
        return self.total / self.peak_seconds if self.peak_seconds > 0 else 0.0

    @property
    def mfu(self) -> float:
        """Model FLOP utilization: the share of the step the FLOPs would take at peak."""
        return self.peak_seconds / self.step_s if self.step_s > 0 else 0.0

    @property
    def precision(self) -> str:
        """The dtypes the FLOPs ran in, most FLOPs first: ``bf16``, ``bf16+fp32``."""
        ranked = sorted(self.by_dtype, key=lambda d: -self.by_dtype[d])
        return "+".join(_SHORT.get(d, d) for d in ranked) or "none"

    def line(self) -> str:
        split = (f" (forward {self.forward / 1e9:.3g}, backward {self.backward / 1e9:.3g})"
                 if self.backward else " (forward)")
        return (f"MFU {self.mfu:.1%}: {self.achieved / 1e9:.3g} GFLOP/s achieved of "
                f"{self.peak_flops / 1e9:.3g} GFLOP/s peak ({self.precision}, measured GEMM "
                f"ceiling); {self.total / 1e9:.3g} GFLOP/step{split}")


def step_flops(w: Workload, step_s: float) -> StepFlops | None:
    """Count one step's FLOPs on ``w``'s eager model and relate them to ``step_s`` and the
    device's peak. None (logged) where the step cannot be counted."""
    model = _eager(w.model)
    try:
        args, kwargs = w.example()
        counter = _FlopsByDtype()
        with torch.no_grad() if not w.training else contextlib.nullcontext():
            with counter:
                out = model(*args, **kwargs)
            forward = sum(counter.by_dtype.values())
            if w.training:
                batch = w._to_device(w.first_batch) if w.is_loader else None
                loss = w.loss_fn(out, batch) if w.loss_fn else default_loss(out)
                with counter:
                    loss.backward()
                model.zero_grad(set_to_none=True)
    except Exception as exc:  # noqa: BLE001 - the figure is evidence, never fatal
        log.info("diagnose: FLOPs not counted: %s: %s", type(exc).__name__, exc)
        return None
    by_dtype = dict(counter.by_dtype)
    notes = []
    applied = _applied_precision(w.model)
    if applied is not None and by_dtype.get("float32"):
        # The eager model counts in fp32 what the optimized graph runs in low precision: the
        # share of its candidate ops the precision pass cast moves to that dtype.
        low, share = applied
        moved = int(by_dtype["float32"] * share)
        by_dtype[low] = by_dtype.get(low, 0) + moved
        by_dtype["float32"] -= moved
        by_dtype = {d: f for d, f in by_dtype.items() if f}
        notes.append(f"FLOPs counted on the eager model; the optimized graph runs {share:.0%} "
                     f"of its matmuls, convolutions and attention ops in {_SHORT[low]} "
                     f"(precision=): that share of the fp32 FLOPs is held to the "
                     f"{_SHORT[low]} peak")
    peak = {d: _peak(w.device, d) for d in by_dtype}
    missing = [d for d, p in peak.items() if not p]
    if missing:
        notes.append(f"no measured peak for {missing}: those FLOPs are left out of MFU")
    return held_to_peak(StepFlops(forward, sum(counter.by_dtype.values()) - forward,
                                  by_dtype, peak, step_s, tuple(notes)), w.device)


def held_to_peak(flops: StepFlops, device: str | torch.device) -> StepFlops:
    """``flops`` against peaks the step does not beat (MFU at most 100%).

    A step whose FLOPs would take longer at the peaks than the step took shows a peak too low:
    measured while the machine was loaded, or on a 512x512 GEMM (2048 on a GPU) that the
    step's larger shapes beat. The ceilings of its dtypes are measured again (once a process;
    the cache keeps the higher figure), and where the step still beats them they are raised
    to what it reached: recorded in the cost cache for a step in one dtype, for this figure
    only (in proportion) for a step in several, whose FLOPs cannot be told apart in time.
    Each change is a note.
    """
    if flops.mfu <= 1.0 or flops.step_s <= 0:
        return flops
    dev = torch.device(device)
    first = flops.mfu
    notes = list(flops.notes)
    peak = {d: _peak(dev, d, remeasure=(str(dev), d, torch.get_num_threads()) not in
                     _REMEASURED) if p else p for d, p in flops.peak.items()}
    _REMEASURED.update((str(dev), d, torch.get_num_threads()) for d in peak)
    flops = dataclasses.replace(flops, peak=peak)
    was = ", ".join(f"{_SHORT.get(d, d)} {p / 1e9:.3g}" for d, p in flops.peak.items() if p)
    if flops.mfu > 1.0:
        scale = flops.mfu
        peak = {d: p * scale for d, p in peak.items()}
        if len(peak) == 1:
            (dtype, reached), = peak.items()
            peak[dtype] = max(reached, raise_matmul_flops(dev, getattr(torch, dtype), reached))
        notes.append(f"the step beat the measured GEMM peak ({first:.0%} MFU; measured again: "
                     f"{was} GFLOP/s): the peak is raised to what the step reached, "
                     + ("and kept in the cost cache" if len(peak) == 1 else
                        "for this figure") + "; MFU reads 100%")
        return dataclasses.replace(flops, peak=peak, notes=tuple(notes))
    notes.append(f"the cached GEMM peak was below what the step reached ({first:.0%} MFU): "
                 f"measured again, {was} GFLOP/s")
    return dataclasses.replace(flops, notes=tuple(notes))


class _FlopsByDtype(TorchDispatchMode):
    """Counts FLOPs with ``FlopCounterMode``'s formulas, per the dtype of each op's inputs."""

    def __init__(self) -> None:
        super().__init__()
        self.by_dtype: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None,
                           ) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        formula = flop_registry.get(func._overloadpacket)
        if formula is not None:
            dtypes = [t.dtype for t in pytree.tree_leaves((args, kwargs))
                      if isinstance(t, torch.Tensor) and t.is_floating_point()]
            dtype = str(dtypes[0]).removeprefix("torch.") if dtypes else "float32"
            self.by_dtype[dtype] += int(formula(*args, **kwargs, out_val=out))
        return out


def _eager(model: nn.Module) -> nn.Module:
    from autoopt.module.optimized import OptimizedModule

    return model.module if isinstance(model, OptimizedModule) else model


def _applied_precision(model: nn.Module) -> tuple[str, float] | None:
    """``(bfloat16 or float16, share of candidate ops cast)`` when ``model`` is an
    OptimizedModule whose graph runs in low precision."""
    report = getattr(model, "report", None)
    for capture in getattr(report, "captures", []) or []:
        summary = getattr(capture, "precision", None)
        if summary is not None and summary.low_ops > 0 and summary.precision in ("bf16",
                                                                                 "fp16"):
            # Ops kept by policy (norms, softmax) are not candidates and count no FLOPs here.
            kept = sum(1 for k in summary.kept if "polic" not in k.why
                       and "practice" not in k.why)
            share = summary.low_ops / (summary.low_ops + kept)
            return {"bf16": "bfloat16", "fp16": "float16"}[summary.precision], share
    return None


# (device, dtype, threads) whose ceiling this process measured again, after a step beat it.
_REMEASURED: set[tuple[str, str, int]] = set()


def _peak(device: torch.device, dtype: str, remeasure: bool = False) -> float:
    """The device's measured GEMM ceiling in ``dtype`` (0.0 where unknown); ``remeasure``
    measures it again, keeping the higher figure."""
    try:
        if dtype in ("float32", "bfloat16", "float16"):
            return matmul_flops(device, getattr(torch, dtype), remeasure=remeasure)
    except (RuntimeError, ValueError) as exc:
        log.info("diagnose: no peak for %s on %s: %s", dtype, device, exc)
    return 0.0
