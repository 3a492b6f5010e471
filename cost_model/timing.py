"""The one place autoopt reads a clock: medians of repeated runs, CUDA events on a GPU."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch


def median_seconds(fn: Callable[[int], object], device: torch.device, *, warmup: int = 2,
                   repeats: int = 7, budget_s: float = 0.5,
                   before: Callable[[], object] | None = None) -> float:
    """Median wall time of ``fn(i)`` (``i`` counts the repeats, for rotating inputs).

    On CUDA each repeat is bracketed by events on the current stream, after warm-up; on the
    CPU by ``time.perf_counter_ns``. ``before()`` runs untimed ahead of each repeat (to evict
    caches, say). Stops early once ``budget_s`` is spent (slow ops still
    get at least three samples).
    """
    return statistics.median(_samples(fn, device, warmup, repeats, budget_s, before))


def best_seconds(fn: Callable[[int], object], device: torch.device, *, warmup: int = 2,
                 repeats: int = 15, best: int = 3, budget_s: float = 0.5) -> float:
    """Median of the ``best`` fastest of ``repeats`` runs of ``fn(i)``: what the device
    reaches when nothing else holds it, for a ceiling.

    On a loaded machine some runs are many times slower (a 512x512 GEMM on two threads took
    1.3 ms or 16 ms, as the second thread was scheduled or not), and a median of all runs
    follows the load; the fastest few do not, and their median is no single lucky sample.
    """
    samples = sorted(_samples(fn, device, warmup, repeats, budget_s, None))
    return statistics.median(samples[:best])


def _samples(fn: Callable[[int], object], device: torch.device, warmup: int, repeats: int,
             budget_s: float, before: Callable[[], object] | None) -> list[float]:
    for i in range(warmup):
        fn(i)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    samples: list[float] = []
    spent = 0.0
    for i in range(repeats):
        if before is not None:
            before()
        if device.type == "cuda":
            start_event = torch.cuda.Event(enable_timing=True)
            end_event = torch.cuda.Event(enable_timing=True)
            start_event.record()
            fn(warmup + i)
            end_event.record()
            end_event.synchronize()
            seconds = start_event.elapsed_time(end_event) / 1e3
        else:
            start = time.perf_counter_ns()
            fn(warmup + i)
            seconds = (time.perf_counter_ns() - start) / 1e9
        samples.append(seconds)
        spent += seconds
        if spent > budget_s and len(samples) >= 3:
            break
    return samples


def timed(fn: Callable[[], Any], device: torch.device) -> tuple[Any, float]:
    """``fn()``'s result and its wall seconds up to the end of its work on ``device`` (one
    call where it stands, e.g. a node inside a model run; no warm-up, no repeats)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter_ns()
    result = fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return result, (time.perf_counter_ns() - start) / 1e9
