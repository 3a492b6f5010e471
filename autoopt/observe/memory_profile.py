"""Where optimize's memory goes: resident memory before, after and at the peak of each stage.

Opt-in and cheap: nothing is recorded unless a ``recording()`` is active in this thread.

    >>> from autoopt import memory_profile
    >>> with memory_profile.recording() as stages:
    ...     fast = autoopt.optimize(model, (x,))
    >>> print(memory_profile.describe(stages))
    stage                    before     after      peak  growth
    capture export          1.52 GiB  1.60 GiB  2.10 GiB  +0.58 GiB
    ...

Each stage (``capture export``, ``pass merge_linear``, ``verify``, ``backend``) is wrapped in
``stage(name)`` where it runs. The peak of a stage is the process's high-water mark of resident
memory while it ran, read from ``/proc/self/status`` (``VmHWM``) after resetting it on entry
(``/proc/self/clear_refs``, Linux); nested stages fold their peaks into their parents'. Where
the reset is not possible the peak is None. On a CUDA device the stage also records
``torch.cuda.max_memory_allocated`` the same way. Every stage is also logged at debug level.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import logging
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from autoopt.cost_model.allowance import (  # noqa: F401 - optimize_memory's allowance, here too
    Allowance,
    allowance,
    allowing,
    free_bytes,
    proc_kib,
    rss_bytes,
    size,
)

log = logging.getLogger(__name__)

_GIB = 2**30


@dataclass
class StageMemory:
    """One stage's resident memory, in bytes.

    Args:
        name: the stage (``pass packed_linear``).
        depth: how deep it is nested in other stages (0: top level).
        before, after: resident set size on entry and on exit.
        peak: the most resident at once while it ran; None where the OS cannot say.
        seconds: wall time of the stage.
        cuda_before, cuda_peak: ``torch.cuda.memory_allocated`` on entry and the most
            allocated while it ran (None without CUDA).
    """

    name: str
    depth: int
    before: int
    after: int = 0
    peak: int | None = None
    seconds: float = 0.0
    cuda_before: int | None = None
    cuda_peak: int | None = None

    @property
    def growth(self) -> int | None:
        """Peak over the memory on entry: what the stage needed beyond what it was given."""
        return None if self.peak is None else self.peak - self.before


_local = threading.local()


def _stages() -> list[StageMemory] | None:
    return getattr(_local, "stages", None)


def peak_rss_bytes() -> int | None:
    """The process's high-water mark of resident memory (``VmHWM``), None where unknown."""
    return proc_kib("/proc/self/status", "VmHWM")


def reset_peak_rss() -> bool:
    """Start the high-water mark afresh at the current resident size; False where the OS
    does not allow it (not Linux, or a kernel without ``clear_refs``)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def release_free_memory() -> None:
    """Free what dropped graphs hold and hand the C heap's free memory back to the system.

    A graph module is a reference cycle (its graph and nodes point back to it), so the weights
    a dropped graph holds (merged copies) are freed only by the cycle collector, which may run
    much later: ``gc.collect()`` first. Memory freed into glibc's heap is then reused only by
    allocations that fit it, not by the packed copies that follow: ``malloc_trim`` returns it
    (Linux with glibc; elsewhere only the collection)."""
    gc.collect()
    global _trim
    if _trim is None:
        try:
            _trim = ctypes.CDLL("libc.so.6").malloc_trim if sys.platform.startswith("linux") \
                else False
        except (OSError, AttributeError):
            _trim = False
    if _trim:
        _trim(0)


_trim: Any = None
_frozen = 0  # captures in progress, any thread, under one gc.freeze()
_frozen_lock = threading.Lock()


@contextlib.contextmanager
def collecting_only_new(full_first: bool = True) -> Iterator[None]:
    """While the block runs, ``release_free_memory``'s collections visit only the objects
    made since it began: what a capture drops (graph modules holding merged or packed
    copies, backend candidates that lost) is made there, while the process's older objects
    (torch, transformers, the model: 560 thousand on a Llama-style decoder) cost a full
    collection 0.3 s each, two a capture and one per candidate dropped. One full collection
    on entry frees what was dropped before (an optimized module deleted, graphs gone
    stale); older objects that become garbage meanwhile (another thread's) wait for the
    next collection after the block (``gc.freeze`` / ``gc.unfreeze``, counted across
    threads). ``full_first=False`` skips the collection on entry, for a caller that knows
    little was dropped since the last one (a graph rebuilt for new weights)."""
    global _frozen
    with _frozen_lock:
        if _frozen == 0:
            if full_first:
                gc.collect()
            gc.freeze()
        _frozen += 1
    try:
        yield
    finally:
        with _frozen_lock:
            _frozen -= 1
            if _frozen == 0:
                gc.unfreeze()


def trim() -> None:
    """Hand the C heap's free memory back to the system, without a collection (milliseconds):
    between verification runs, whose outputs (LM logits) are freed in the middle of the heap
    and would otherwise stay resident, each run's landing on new pages."""
    global _trim
    if _trim is None:
        release_free_memory()
    elif _trim:
        _trim(0)


@contextlib.contextmanager
def recording() -> Iterator[list[StageMemory]]:
    """Record every ``stage`` run in this thread inside the block; yields the list it fills,
    outermost stages first (in entry order)."""
    previous = _stages()
    _local.stages, _local.open = [], []
    try:
        yield _local.stages
    finally:
        _local.stages, _local.open = previous, []


def _fold_peak() -> None:
    """Credit the high-water mark since the last reset to every open stage."""
    peak = peak_rss_bytes()
    cuda = torch.cuda.max_memory_allocated() if _cuda() else None
    for s in _local.open:
        if peak is not None and s.peak is not None:
            s.peak = max(s.peak, peak)
        if cuda is not None and s.cuda_peak is not None:
            s.cuda_peak = max(s.cuda_peak, cuda)


def _cuda() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_initialized()


@contextlib.contextmanager
def stage(name: str) -> Iterator[None]:
    """Record the block's memory as stage ``name`` when a ``recording()`` is active; otherwise
    do nothing."""
    stages = _stages()
    if stages is None:
        yield
        return
    _fold_peak()
    record = StageMemory(name, len(_local.open), rss_bytes())
    if reset_peak_rss():
        record.peak = record.before
    if _cuda():
        record.cuda_before = record.cuda_peak = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    stages.append(record)
    _local.open.append(record)
    start = time.perf_counter()
    try:
        yield
    finally:
        record.seconds = time.perf_counter() - start
        _fold_peak()
        _local.open.pop()
        record.after = rss_bytes()
        if record.peak is not None:
            record.peak = max(record.peak, record.after)
        log.debug("memory: %s: %.2f -> %.2f GiB, peak %s, %.2f s", name, record.before / _GIB,
                  record.after / _GIB, "?" if record.peak is None
                  else f"{record.peak / _GIB:.2f} GiB", record.seconds)


def describe(stages: list[StageMemory]) -> str:
    """A table of the stages: resident memory before, after, at the peak, and the growth."""
    lines = [f"{'stage':<32} {'before':>9} {'after':>9} {'peak':>9} {'growth':>9} {'s':>6}"]
    for s in stages:
        peak = "?" if s.peak is None else f"{s.peak / _GIB:.2f}"
        growth = "?" if s.growth is None else f"{s.growth / _GIB:+.2f}"
        lines.append(f"{'  ' * s.depth + s.name:<32} {s.before / _GIB:9.2f} "
                     f"{s.after / _GIB:9.2f} {peak:>9} {growth:>9} {s.seconds:6.1f}")
    return "\n".join(lines) + "\n(GiB of resident memory)"

