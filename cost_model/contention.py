"""Whether a measurement was taken while other processes held the cores it needed.

On a shared CPU a timing is the model's time plus the time its threads waited for a core: a
candidate measured while another job ran looks slower than it is, and one measured in a quiet
moment looks faster. ``Watch`` brackets a measurement and reads, from ``/proc/stat`` and this
process's CPU clock, how many cores other processes kept busy meanwhile; the measurement was
shared when fewer cores were left than this process's intra-op threads.

``spread`` and ``close`` say when a set of interleaved samples does not decide a choice: the
samples disagree widely, or two candidates' medians lie within that disagreement.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

# Cores' worth of slack before a measurement counts as shared: the CPU time of short-lived
# system work (a daemon's tick, this process's own Python between runs) is not a competitor.
_SLACK_CORES = 0.25
# An interquartile range wider than this share of the median: the samples do not agree.
WIDE_SPREAD = 0.2


def proc_stat() -> tuple[int, int] | None:
    """(busy, total) jiffies of all CPUs since boot, or None off Linux."""
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return sum(fields) - idle, sum(fields)


@dataclass(frozen=True)
class Sharing:
    """Over one measurement: ``cores``, the machine's; ``others``, cores' worth of time other
    processes kept busy; ``threads``, this process's intra-op threads."""

    cores: int
    others: float
    threads: int

    @property
    def shared(self) -> bool:
        """Other processes held cores this process's threads needed."""
        return self.cores - self.others < min(self.threads, self.cores) - _SLACK_CORES

    def describe(self) -> str:
        return (f"other processes kept {self.others:.1f} of the {self.cores} cores busy while "
                f"this process ran {self.threads} thread(s)")


class Watch:
    """Brackets a measurement (``with Watch() as watch: ...``); then ``watch.sharing`` says
    how the machine was shared meanwhile, None where that cannot be read (not Linux)."""

    def __init__(self) -> None:
        self.sharing: Sharing | None = None

    def __enter__(self) -> Watch:
        self._stat, self._cpu, self._wall = proc_stat(), time.process_time(), time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        stat, cpu, wall = proc_stat(), time.process_time(), time.perf_counter() - self._wall
        if self._stat is None or stat is None or stat[1] <= self._stat[1] or wall <= 0:
            return
        cores = os.cpu_count() or 1
        busy = (stat[0] - self._stat[0]) / (stat[1] - self._stat[1]) * cores
        ours = (cpu - self._cpu) / wall  # this process's busy cores
        self.sharing = Sharing(cores, max(0.0, busy - ours), torch.get_num_threads())


def spread(samples: Sequence[float]) -> float:
    """The interquartile range of ``samples`` over their median (0 for fewer than four)."""
    if len(samples) < 4:
        return 0.0
    q1, _, q3 = statistics.quantiles(samples, n=4)
    median = statistics.median(samples)
    return (q3 - q1) / median if median > 0 else 0.0


def undecided(samples: dict[str, Sequence[float]]) -> str:
    """Why interleaved ``samples`` (by candidate) do not decide which is fastest, or "": a
    candidate's samples disagree by more than ``WIDE_SPREAD``, or the two fastest medians lie
    within their samples' disagreement."""
    spreads = {name: spread(s) for name, s in samples.items() if s}
    wide = {name: s for name, s in spreads.items() if s > WIDE_SPREAD}
    if wide:
        name, value = max(wide.items(), key=lambda item: item[1])
        return f"{name}'s runs disagree by {value:.0%} (interquartile range over the median)"
    medians = sorted((statistics.median(s), name) for name, s in samples.items() if s)
    if len(medians) >= 2 and medians[0][0] > 0:
        (a, first), (b, second) = medians[:2]
        margin = max(spreads.get(first, 0.0), spreads.get(second, 0.0))
        if margin > 0 and (b - a) / a < margin:
            return (f"{first} and {second} are {(b - a) / a:.1%} apart, within their runs' "
                    f"disagreement ({margin:.0%})")
    return ""
