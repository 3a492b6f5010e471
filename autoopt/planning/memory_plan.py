"""Plan activation memory for training under a budget: keep, offload or recompute segments.

The forward graph is cut into contiguous segments (``autoopt.planning.activations``), and a
plan gives each a mode (``autoopt.planning.segments``, which also prices a plan). The planner
is an exact dynamic program over segments on bytes rounded up to ``budget / 4096`` steps, in
which a storage two segments hold counts twice (so a plan it returns always fits); with a time
limit, a greedy alternative that counts shared storages once, and a local search that improves
either by changing one or two segments at a time while the plan still fits.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from autoopt.planning.segments import (
    KEEP,
    MODES,
    OFFLOAD,
    RECOMPUTE,
    SELECTIVE,
    SavedActivation,
    Segment,
    Storages,
    added_seconds,
    offload_seconds,
    peak_bytes,
)

log = logging.getLogger(__name__)

_STEPS = 4096  # byte resolution of the dynamic program: budget / _STEPS


class BudgetTooSmall(ValueError):
    """No plan meets the budget. ``smallest`` is the least budget (bytes) a plan meets."""

    def __init__(self, budget: int, smallest: int, unconstrained: int,
                 modes: Sequence[str] = MODES, used: Sequence[str] | None = None) -> None:
        self.budget, self.smallest, self.unconstrained = budget, smallest, unconstrained
        super().__init__(
            f"no plan with modes {describe_modes(modes, used)} keeps saved activations within "
            f"{format_bytes(budget)}; the smallest budget a plan meets is "
            f"{format_bytes(smallest)} ({smallest} bytes, "
            f"{smallest / max(unconstrained, 1):.0%} of the {format_bytes(unconstrained)} "
            f"saved without a plan)")


@dataclass(frozen=True)
class MemoryPlan:
    """One mode per segment, with what it costs.

    Args:
        segments: the segments, in forward order.
        modes: ``keep``, ``offload`` or ``recompute`` for each segment.
        budget: the saved-activation budget in bytes.
        link_bandwidth: device<->host bytes/s used to price offloading.
        overlap: whether copies overlap compute (a GPU side stream) or not (host as both ends).
        method: ``keep-all`` (fits as is), ``dp``, ``greedy`` or ``given``.
        activations: every saved activation with its size and lifetime.
        requested: the modes asked for (``memory_modes``); empty when not known.
        available: the modes the planner could choose from (``keep`` always; ``offload``
            only over a known link); empty when not known.
        notes: what else the plan's reader should know (a mode left out, and why).
    """

    segments: tuple[Segment, ...]
    modes: tuple[str, ...]
    budget: int
    link_bandwidth: float
    overlap: bool = False
    method: str = "given"
    activations: tuple[SavedActivation, ...] = field(default=(), repr=False)
    requested: tuple[str, ...] = ()
    available: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()

    @property
    def unconstrained_bytes(self) -> int:
        """Saved-activation bytes with every segment kept."""
        return peak_bytes(self.segments, [KEEP] * len(self.segments))

    @property
    def peak_bytes(self) -> int:
        """Most saved-activation bytes alive at once under this plan (see the module doc)."""
        return peak_bytes(self.segments, self.modes)

    @property
    def added_seconds(self) -> float:
        """Predicted step time this plan adds to keeping everything."""
        return sum(added_seconds(self.segments, self.modes, self.link_bandwidth, self.overlap))

    def count(self, mode: str) -> int:
        return sum(m == mode for m in self.modes)

    def describe(self) -> str:
        """The plan in plain words, one line per segment."""
        lines = [f"memory plan ({self.method}): budget {format_bytes(self.budget)} for saved "
                 f"activations; without a plan {format_bytes(self.unconstrained_bytes)}, with "
                 f"it {format_bytes(self.peak_bytes)} at most; about "
                 f"{self.added_seconds * 1e3:.2f} ms added per step "
                 f"({self.count(KEEP)} kept, {self.count(OFFLOAD)} offloaded, "
                 f"{self.count(SELECTIVE)} recomputed selectively, "
                 f"{self.count(RECOMPUTE)} recomputed)"]
        if self.requested:
            lines.append(f"  modes: {describe_modes(self.requested, self.available or None)}")
        lines.extend(f"  note: {note}" for note in self.notes)
        costs = added_seconds(self.segments, self.modes, self.link_bandwidth, self.overlap)
        for seg, mode, cost in zip(self.segments, self.modes, costs, strict=True):
            what = {KEEP: "keep on device",
                    OFFLOAD: "offload to host, prefetch before its backward",
                    SELECTIVE: "recompute its cheap ops in backward (keep its inputs and "
                               f"matmul/conv/attention results, "
                               f"{format_bytes(seg.input_bytes + seg.heavy_bytes)})",
                    RECOMPUTE: "recompute in backward (keep its inputs, "
                               f"{format_bytes(seg.input_bytes)})"}[mode]
            extra = f", +{cost * 1e3:.2f} ms" if mode != KEEP else ""
            lines.append(f"  {seg.describe()}: saves {format_bytes(seg.saved_bytes)}; "
                         f"{what}{extra}")
        return "\n".join(lines)


    def describe_activations(self, top: int = 10) -> str:
        """The largest saved activations, each with its size and lifetime, and what the plan
        does with it."""
        lines = [f"largest saved activations ({len(self.activations)} in all):"]
        for a in sorted(self.activations, key=lambda a: -a.nbytes)[:top]:
            lines.append(f"  {format_bytes(a.nbytes):>10}  {a.producer}, saved by {a.saved_by}: "
                         f"alive from its forward to the backward of segment {a.segment} "
                         f"({self.modes[a.segment]})")
        return "\n".join(lines)


def describe_modes(requested: Sequence[str], available: Sequence[str] | None = None) -> str:
    """The modes asked of the planner and what it could use, in words:
    ``recompute (and keep, always allowed)``."""
    text = "/".join(m for m in MODES if m in requested)
    if KEEP not in requested:
        text += " (and keep, always allowed)"
    left_out = [m for m in requested if available is not None and m not in available]
    if left_out:
        text += f"; {'/'.join(left_out)} not available here (no device-host link measured)"
    return text


def format_bytes(n: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{int(n)} B"


# --- planning ------------------------------------------------------------------------------


def plan_memory(segments: Sequence[Segment], budget: int, *, modes: Sequence[str] = MODES,
                link_bandwidth: float = 0.0, overlap: bool = False, time_limit_s: float = 2.0,
                activations: Sequence[SavedActivation] = (),
                notes: Sequence[str] = ()) -> MemoryPlan:
    """The plan of least added step time whose saved activations fit in ``budget`` bytes.

    Args:
        segments: the forward graph's segments (``ActivationProfile.segments``).
        budget: bytes of saved activations allowed on the device.
        modes: the modes to choose from (``keep`` is always allowed).
        link_bandwidth: device<->host bytes/s for pricing offload (0: no offload).
        overlap: whether copies overlap compute (GPU side stream).
        time_limit_s: for the exact search, after which the greedy plan is used.
        activations: carried into the plan for its description.
        notes: carried into the plan for its description.

    Raises:
        BudgetTooSmall: no plan fits; it names the smallest budget that does.
    """
    allowed = tuple(m for m in MODES if m in set(modes) | {KEEP})
    if link_bandwidth <= 0:
        allowed = tuple(m for m in allowed if m != OFFLOAD)
    segments = tuple(segments)

    def make(chosen: Sequence[str], method: str) -> MemoryPlan:
        return MemoryPlan(segments, tuple(chosen), budget, link_bandwidth, overlap, method,
                          tuple(activations), tuple(m for m in MODES if m in modes), allowed,
                          tuple(notes))

    keep_all = [KEEP] * len(segments)
    if peak_bytes(segments, keep_all) <= budget:
        return make(keep_all, "keep-all")
    chosen = _search(segments, budget, allowed, link_bandwidth, overlap, time_limit_s)
    if chosen is None:
        raise BudgetTooSmall(budget, smallest_budget(segments, allowed, link_bandwidth, overlap),
                             peak_bytes(segments, keep_all), modes, allowed)
    return make(*chosen)


def _search(segments: Sequence[Segment], budget: int, allowed: Sequence[str], bandwidth: float,
            overlap: bool, time_limit_s: float, exact_only: bool = False,
            ) -> tuple[list[str], str] | None:
    """The dynamic program's plan, or the greedy one where that is cheaper (the program
    counts a storage two segments hold twice, the greedy search once) or the program ran
    out of time; None when neither fits."""
    deadline = time.perf_counter() + time_limit_s
    found: list[tuple[list[str], str]] = []
    try:
        exact = _dynamic_program(segments, budget, allowed, bandwidth, overlap, deadline)
        if exact is not None:
            found.append((exact, "dp"))
    except TimeoutError:
        log.info("memory plan: exact search ran past %.1f s; using the greedy plan",
                 time_limit_s)
    if not exact_only:
        greedy = _greedy(segments, budget, allowed, bandwidth, overlap)
        if greedy is not None:
            found.append((greedy, "greedy"))
    if exact_only or not found:
        return min(found, key=lambda f: sum(added_seconds(segments, f[0], bandwidth, overlap)),
                   default=None)
    storages = Storages(segments)
    improved = [(_improve(storages, segments, chosen, budget, allowed, bandwidth, overlap),
                 method) for chosen, method in found]
    return min(improved, key=lambda f: sum(added_seconds(segments, f[0], bandwidth, overlap)))


def _improve(storages: Storages, segments: Sequence[Segment], chosen: list[str], budget: int,
             allowed: Sequence[str], bandwidth: float, overlap: bool,
             time_limit_s: float = 2.0) -> list[str]:
    """Change the modes of one or two segments at a time while that saves time and still fits,
    counting shared storages once (the dynamic program counted them twice, so it may have paid
    for bytes that were not there; the greedy plan is myopic)."""
    deadline = time.perf_counter() + time_limit_s
    chosen = list(chosen)
    costs = [_mode_costs(segments, i, allowed, bandwidth, overlap) for i in range(len(chosen))]
    moves = [(i, m) for i in range(len(chosen)) for m in allowed if segments[i].permits(m)]
    while time.perf_counter() < deadline:
        best: tuple[float, list[str]] | None = None
        for first, (i, a) in enumerate(moves):
            if a == chosen[i]:
                continue
            for j, b in [(i, a), *moves[first + 1:]]:
                if j == i and b != a or b == chosen[j]:
                    continue
                trial = list(chosen)
                trial[i], trial[j] = a, b
                saving = sum(costs[k][chosen[k]] - costs[k][trial[k]] for k in {i, j})
                if saving > 1e-12 and (best is None or saving > best[0]) \
                        and storages.peak(trial) <= budget:
                    best = (saving, trial)
        if best is None:
            break
        chosen = best[1]
    return chosen


def _mode_costs(segments: Sequence[Segment], i: int, allowed: Sequence[str], bandwidth: float,
                overlap: bool) -> dict[str, float]:
    seg = segments[i]
    return {mode: (seg.rerun_seconds(mode) if mode in (RECOMPUTE, SELECTIVE) else
                   offload_seconds(segments, i, bandwidth, overlap) if mode == OFFLOAD
                   else 0.0) for mode in allowed}


def smallest_budget(segments: Sequence[Segment], allowed: Sequence[str], bandwidth: float,
                    overlap: bool) -> int:
    """The least budget (bytes, within 1%) for which a plan exists."""
    keep_all = [KEEP] * len(segments)
    lo, hi = 0, peak_bytes(segments, keep_all)
    while hi - lo > max(1, hi // 100):
        mid = (lo + hi) // 2
        if _search(segments, mid, allowed, bandwidth, overlap, 1.0, exact_only=True):
            hi = mid
        else:
            lo = mid
    return hi  # the search found a plan for hi (or hi is the unconstrained need)


def _resident(seg: Segment, mode: str) -> int:
    return {KEEP: seg.saved_bytes, OFFLOAD: 0, RECOMPUTE: seg.input_bytes,
            SELECTIVE: seg.input_bytes + seg.heavy_bytes}[mode]


def _dynamic_program(segments: Sequence[Segment], budget: int, allowed: Sequence[str],
                     bandwidth: float, overlap: bool, deadline: float) -> list[str] | None:
    """Least added time over plans, state = (resident bytes in steps, previous offloaded).

    Bytes are rounded up to steps of ``budget / _STEPS``, so every plan found fits exactly.
    """
    if budget <= 0 or not segments:
        return None
    unit = budget / _STEPS

    def steps(n: int) -> int:
        return math.ceil(n / unit)

    inf = math.inf
    best = np.full((2, _STEPS + 1), inf)  # [previous segment offloaded?][resident steps]
    best[0, 0] = 0.0
    back = []  # per segment: (mode index, previous flag, previous resident) per new state
    for i, seg in enumerate(segments):
        if time.perf_counter() > deadline:
            raise TimeoutError
        new = np.full((2, _STEPS + 1), inf)
        mode_of = np.full((2, _STEPS + 1), -1, dtype=np.int8)
        flag_of = np.zeros((2, _STEPS + 1), dtype=np.int8)
        from_of = np.zeros((2, _STEPS + 1), dtype=np.int32)
        for m, mode in enumerate(allowed):
            if not seg.permits(mode):
                continue
            cost = (seg.rerun_seconds(mode) if mode in (RECOMPUTE, SELECTIVE) else
                    offload_seconds(segments, i, bandwidth, overlap) if mode == OFFLOAD
                    else 0.0)
            own = steps(_resident(seg, mode))
            during = steps(seg.saved_bytes) + (steps(_resident(seg, mode))
                                               if mode in (RECOMPUTE, SELECTIVE) else 0)
            to_flag = int(mode == OFFLOAD)
            for flag in (0, 1):
                prefetch = steps(segments[i - 1].saved_bytes) if flag and i else 0
                limit = min(_STEPS - own, _STEPS - during - prefetch)
                if limit < 0:
                    continue
                candidate = best[flag, :limit + 1] + cost
                target = slice(own, own + limit + 1)
                better = candidate < new[to_flag, target]
                new[to_flag, target] = np.where(better, candidate, new[to_flag, target])
                mode_of[to_flag, target] = np.where(better, m, mode_of[to_flag, target])
                flag_of[to_flag, target] = np.where(better, flag, flag_of[to_flag, target])
                from_of[to_flag, target] = np.where(better, np.arange(limit + 1),
                                                    from_of[to_flag, target])
        best = new
        back.append((mode_of, flag_of, from_of))
    if not np.isfinite(best).any():
        return None
    flag, resident = np.unravel_index(int(np.argmin(best)), best.shape)
    chosen: list[str] = []
    for mode_of, flag_of, from_of in reversed(back):
        chosen.append(allowed[int(mode_of[flag, resident])])
        flag, resident = int(flag_of[flag, resident]), int(from_of[flag, resident])
    return chosen[::-1]


def _greedy(segments: Sequence[Segment], budget: int, allowed: Sequence[str], bandwidth: float,
            overlap: bool) -> list[str] | None:
    """Repeatedly take the change that frees the most peak bytes per added second."""
    storages = Storages(segments)
    chosen = [KEEP] * len(segments)
    while (peak := storages.peak(chosen)) > budget:
        best: tuple[float, int, str] | None = None
        for i, current in enumerate(chosen):
            for mode in allowed:
                if mode == current or not segments[i].permits(mode):
                    continue
                trial = chosen[:i] + [mode] + chosen[i + 1:]
                freed = peak - storages.peak(trial)
                extra = sum(added_seconds(segments, trial, bandwidth, overlap)) - \
                    sum(added_seconds(segments, chosen, bandwidth, overlap))
                if freed > 0:
                    score = freed / max(extra, 1e-12)
                    if best is None or score > best[0]:
                        best = (score, i, mode)
        if best is None:
            return None
        chosen[best[1]] = best[2]
    return chosen
