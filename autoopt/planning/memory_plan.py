"""Plan activation memory for training under a budget: keep, offload or recompute segments.

The forward graph is cut into contiguous segments. For each segment the plan chooses what
happens to the tensors its ops save for backward:

    keep       they stay on the device until its backward (no added time)
    offload    they are copied to host memory during forward and brought back, ahead of use,
               during backward (added time: the part of the copies compute does not hide)
    selective  its inputs and the results of its matmuls, convolutions and attention are kept;
               its other ops run again in backward (added time: those ops)
    recompute  only the segment's inputs are kept; its forward runs again in backward
               (added time: the segment's forward up to its last op that saves a tensor)

The saved-activation memory of a plan, in segment order ``0..n-1``, is the larger of

    after forward:          |union_j resident_j|
    in backward of seg i:   |union_{j<i} resident_j + saved_i + resident_i|
                            (+ saved_{i-1} if seg i-1 is offloaded: it is being prefetched)

with ``resident`` = saved storages (keep), inputs (recompute), inputs and heavy results
(selective) or nothing (offload), each storage counted once however many segments hold it.
The planner is an exact dynamic program over segments on bytes rounded up to ``budget / 4096``
steps, in which a storage two segments hold counts twice (so a plan it returns always fits);
with a time limit, a greedy alternative that counts shared storages once, and a local search
that improves either by changing one or two segments at a time while the plan still fits.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch.fx import GraphModule, Interpreter, Node
from torch.utils import _pytree as pytree

from autoopt.cost_model.isolation import preserved, unwritten_inputs

from ..passes import ops

log = logging.getLogger(__name__)

KEEP, OFFLOAD, SELECTIVE, RECOMPUTE = "keep", "offload", "selective", "recompute"
MODES: tuple[str, ...] = (KEEP, OFFLOAD, SELECTIVE, RECOMPUTE)
# Ops whose results a selective recompute keeps (costly to run again, per byte they make): the
# graph-level spellings, for planning, and the kernels a decomposed graph calls. Each runs as one
# of ``ops.COSTLY_KERNELS``, which ``autoopt.passes.recompute`` keeps.
_HEAVY_OPS = ops.COSTLY | ops.ATTENTION_KERNELS
_STEPS = 4096  # byte resolution of the dynamic program: budget / _STEPS
_COMPUTE_OPS = ("call_function", "call_method", "call_module")


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
class SavedActivation:
    """A tensor an op saves for backward.

    Lifetime: created by ``producer`` in forward, needed until the backward of ``segment``.

    Args:
        saved_by: the node whose op saved it.
        producer: the node (or graph input) whose result it is, or ``?`` when not found.
        nbytes: bytes of its storage.
        segment: the segment of ``saved_by``.
    """

    saved_by: str
    producer: str
    nbytes: int
    segment: int


@dataclass(frozen=True)
class Segment:
    """A contiguous run of the forward graph's compute nodes.

    Storages are named by an id (one per distinct storage of the run) so that a tensor two
    segments save, or one saves and the next takes as input, is counted once.

    Args:
        index: position in forward order.
        nodes: the names of its nodes.
        saved: (storage id, bytes) its ops save for backward, parameters excluded.
        inputs: (storage id, bytes) of the activations flowing in, which a recomputed segment
            keeps alive.
        forward_s: predicted forward time.
        heavy: (storage id, bytes) of the results of its matmuls, convolutions and attention,
            which a selective recompute keeps.
        recompute_s: time to run it again in backward (up to the last op that saves a tensor:
            checkpoint stops there); None: ``forward_s``.
        selective_s: the same without the heavy ops; None: ``recompute_s``.
        writes_state: an op in it writes module state (BatchNorm running statistics).
    """

    index: int
    nodes: tuple[str, ...]
    saved: tuple[tuple[int, int], ...]
    inputs: tuple[tuple[int, int], ...]
    forward_s: float
    heavy: tuple[tuple[int, int], ...] = ()
    recompute_s: float | None = None
    selective_s: float | None = None
    writes_state: bool = False

    def permits(self, mode: str) -> bool:
        """Selective recompute cannot put back state its ops write (BatchNorm statistics):
        the snapshot it would take in backward is an op the forward did not run."""
        return not (mode == SELECTIVE and self.writes_state)

    def rerun_seconds(self, mode: str) -> float:
        """Added time of recomputing it fully or selectively."""
        full = self.forward_s if self.recompute_s is None else self.recompute_s
        if mode == SELECTIVE and self.selective_s is not None:
            return self.selective_s
        return full

    @property
    def heavy_bytes(self) -> int:
        return sum(b for _, b in self.heavy)

    @property
    def saved_bytes(self) -> int:
        return sum(b for _, b in self.saved)

    @property
    def input_bytes(self) -> int:
        return sum(b for _, b in self.inputs)

    def describe(self) -> str:
        span = self.nodes[0] if len(self.nodes) == 1 else f"{self.nodes[0]}..{self.nodes[-1]}"
        return f"segment {self.index:>2} ({len(self.nodes):>3} ops, {span})"


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


# --- the cost of a plan --------------------------------------------------------------------


def _resident(seg: Segment, mode: str) -> int:
    return {KEEP: seg.saved_bytes, OFFLOAD: 0, RECOMPUTE: seg.input_bytes,
            SELECTIVE: seg.input_bytes + seg.heavy_bytes}[mode]


class _Storages:
    """The segments' storages as boolean masks, for exact byte counts of unions."""

    def __init__(self, segments: Sequence[Segment]) -> None:
        ids = sorted({sid for seg in segments
                      for sid, _ in (*seg.saved, *seg.inputs, *seg.heavy)})
        index = {sid: i for i, sid in enumerate(ids)}
        self.sizes = np.zeros(len(ids), dtype=np.int64)
        self.saved, self.inputs, self.heavy = (np.zeros((len(segments), len(ids)), dtype=bool)
                                               for _ in range(3))
        for s, seg in enumerate(segments):
            for mask, pairs in ((self.saved, seg.saved), (self.inputs, seg.inputs),
                                (self.heavy, seg.heavy)):
                for sid, nbytes in pairs:
                    mask[s, index[sid]] = True
                    self.sizes[index[sid]] = nbytes

    def peak(self, modes: Sequence[str]) -> int:
        resident = np.zeros(len(self.sizes), dtype=bool)
        peak = 0
        for i, mode in enumerate(modes):
            held = self._held(i, mode)
            during = resident | held | self.saved[i]
            if i and modes[i - 1] == OFFLOAD:
                during |= self.saved[i - 1]  # prefetched while segment i runs backward
            peak = max(peak, int(self.sizes[during].sum()))
            resident |= held
        return max(peak, int(self.sizes[resident].sum()))


    def _held(self, i: int, mode: str) -> np.ndarray:
        """What segment ``i`` keeps on the device from its forward to its backward."""
        if mode == KEEP:
            return self.saved[i]
        if mode == RECOMPUTE:
            return self.inputs[i]
        if mode == SELECTIVE:
            return self.inputs[i] | self.heavy[i]
        return np.zeros_like(self.saved[i])


def peak_bytes(segments: Sequence[Segment], modes: Sequence[str]) -> int:
    """Most saved-activation bytes alive at once when ``segments`` run under ``modes``
    (each storage counted once, however many segments hold it)."""
    return _Storages(segments).peak(modes)


def added_seconds(segments: Sequence[Segment], modes: Sequence[str], bandwidth: float,
                  overlap: bool) -> list[float]:
    """Per segment, the predicted time its mode adds to a training step."""
    costs = []
    for i, (seg, mode) in enumerate(zip(segments, modes, strict=True)):
        if mode in (RECOMPUTE, SELECTIVE):
            costs.append(seg.rerun_seconds(mode))
        elif mode == OFFLOAD:
            costs.append(_offload_seconds(segments, i, bandwidth, overlap))
        else:
            costs.append(0.0)
    return costs


def _offload_seconds(segments: Sequence[Segment], i: int, bandwidth: float,
                     overlap: bool) -> float:
    copy = segments[i].saved_bytes / bandwidth if bandwidth > 0 else math.inf
    if not overlap:
        return 2 * copy
    # The copy out hides behind the next segment's forward; the copy back (prefetched when
    # the next segment's backward starts) behind that backward, about twice its forward.
    window = segments[i + 1].forward_s if i + 1 < len(segments) else 0.0
    return max(0.0, copy - window) + max(0.0, copy - 2 * window)


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
    storages = _Storages(segments)
    improved = [(_improve(storages, segments, chosen, budget, allowed, bandwidth, overlap),
                 method) for chosen, method in found]
    return min(improved, key=lambda f: sum(added_seconds(segments, f[0], bandwidth, overlap)))


def _improve(storages: _Storages, segments: Sequence[Segment], chosen: list[str], budget: int,
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
                   _offload_seconds(segments, i, bandwidth, overlap) if mode == OFFLOAD
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
                    _offload_seconds(segments, i, bandwidth, overlap) if mode == OFFLOAD
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
    storages = _Storages(segments)
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


# --- segments and their saved activations, from the graph -----------------------------------


@dataclass
class ActivationProfile:
    """What one run of the graph with gradients saved for backward, per node, and each node's
    predicted forward time; cut it into segments with ``segments(count)``.

    Args:
        order: the compute nodes in execution order.
        saved_by_node: per node, the storages (pointer -> bytes) its op saved.
        producer: per storage pointer, the node that produced it.
        storage_of: per node, its result's storage (pointer, bytes), parameters excluded.
        times: per node, predicted forward seconds.
        heavy_nodes: the matmul, convolution and attention nodes (kept by selective
            recompute).
    """

    order: list[Node]
    saved_by_node: dict[str, dict[int, int]]
    producer: dict[int, str]
    storage_of: dict[str, tuple[int, int]]
    times: dict[str, float]
    heavy_nodes: frozenset[str] = frozenset()

    @property
    def saved_bytes(self) -> int:
        """Bytes of distinct storages saved over the whole graph."""
        return sum({p: b for per in self.saved_by_node.values() for p, b in per.items()}.values())

    def segments(self, count: int) -> tuple[list[Segment], list[SavedActivation]]:
        """Cut into up to ``count`` contiguous segments of near-equal saved bytes."""
        segments, activations = [], []
        groups = _cut(self.order, self.saved_by_node, self.storage_of, count)
        for index, group in enumerate(groups):
            names = {n.name for n in group}
            saved: dict[int, int] = {}
            inputs: dict[int, int] = {}
            for node in group:
                for ptr, nbytes in self.saved_by_node.get(node.name, {}).items():
                    saved[ptr] = nbytes
                    activations.append(SavedActivation(node.name, self.producer.get(ptr, "?"),
                                                       nbytes, index))
                for arg in _node_args(node):
                    if arg.name not in names and arg.name in self.storage_of:
                        ptr, nbytes = self.storage_of[arg.name]
                        inputs[ptr] = nbytes
            heavy: dict[int, int] = {}
            for node in group:
                if node.name in self.heavy_nodes:
                    heavy.update(self._results(node.name))
            # Checkpoint's rerun stops after the last op that saves a tensor.
            saving = [i for i, n in enumerate(group) if self.saved_by_node.get(n.name)]
            rerun = group[:saving[-1] + 1] if saving else []
            segments.append(Segment(
                index, tuple(n.name for n in group), tuple(saved.items()),
                tuple(inputs.items()), sum(self.times.get(n, 0.0) for n in names),
                tuple(heavy.items()), sum(self.times.get(n.name, 0.0) for n in rerun),
                sum(self.times.get(n.name, 0.0) for n in rerun
                    if n.name not in self.heavy_nodes),
                any(_writes_state(n) for n in group)))
        return segments, activations

    def _results(self, name: str) -> dict[int, int]:
        """The storages a node makes: its result, and what it saves that no node returned
        (an attention kernel's log-sum-exp)."""
        made = dict([self.storage_of[name]]) if name in self.storage_of else {}
        for ptr, nbytes in self.saved_by_node.get(name, {}).items():
            if self.producer.get(ptr, name) == name:
                made[ptr] = nbytes
        return made


def profile_activations(gm: GraphModule, example_inputs: Sequence[Any],
                        cost: Any = None) -> ActivationProfile:
    """Run ``gm`` once with gradients and saved-tensor hooks to list what each node saves;
    price each node's forward with ``cost`` (a ``CostModel``; None: every node 0 s).

    The runs leave no trace: buffers (BatchNorm statistics, counters), Python attributes, the
    inputs and the RNG are as they were (``preserved``).
    """
    recorder = _SavedRecorder(gm)
    times: dict[str, float] = {}
    with preserved(gm, example_inputs):
        recorder.record(unwritten_inputs(gm, example_inputs))
    if cost is not None:
        graph_cost = cost.profile(gm, list(example_inputs))  # which puts back what it changes
        times = {name: c.latency_s for name, c in graph_cost.by_node.items()}
    order = [n for n in gm.graph.nodes if n.op in _COMPUTE_OPS and str(n.target) != "_guards_fn"]
    heavy = frozenset(n.name for n in order if _is_heavy(n, gm))
    return ActivationProfile(order, recorder.saved_by_node, recorder.producer,
                             recorder.storage_of, times, heavy)


def _writes_state(node: Node) -> bool:
    """Whether the op writes in place (per its schema) or updates running statistics."""
    if node.op == "call_module":
        return True  # a module may hold state (symbolic_trace graphs): assume it does
    schema = getattr(node.target, "_schema", None)
    if schema is not None and schema.is_mutable:
        return True
    return "batch_norm" in str(node.target) or "instance_norm" in str(node.target)


def _is_heavy(node: Node, gm: GraphModule) -> bool:
    if node.op == "call_module":
        module = gm.get_submodule(str(node.target))
        # Subclasses too (LazyLinear, a user's Conv2d subclass): they still run a GEMM.
        return isinstance(module, _HEAVY_OPS.modules)
    return node.op == "call_function" and node.target in _HEAVY_OPS.functions


def _cut(order: Sequence[Node], saved: dict[str, dict[int, int]],
         storage_of: dict[str, tuple[int, int]], count: int) -> list[list[Node]]:
    """``count`` contiguous groups of near-equal saved bytes, each cut moved to the point
    nearby where the fewest activation bytes cross it (a recomputed segment keeps what
    crosses its start, so narrow cuts make recompute pay)."""
    weights = [sum(saved.get(n.name, {}).values()) for n in order]
    total = sum(weights) or 1
    running, cuts = 0, []
    for i, w in enumerate(weights):
        group = min(count - 1, int((running + w / 2) / total * count))
        if i and group > len(cuts):
            cuts.append(i)
        running += w
    crossing = _crossing_bytes(order, storage_of)
    reach = max(1, len(order) // (4 * max(count, 1)))
    snapped = []
    for cut in cuts:
        window = range(max(1, cut - reach), min(len(order) - 1, cut + reach) + 1)
        snapped.append(min(window, key=lambda p: (crossing[p], abs(p - cut)), default=cut))
    bounds = [0, *sorted(set(snapped)), len(order)]
    return [list(order[a:b]) for a, b in zip(bounds, bounds[1:], strict=False) if b > a]


def _crossing_bytes(order: Sequence[Node], storage_of: dict[str, tuple[int, int]]) -> list[int]:
    """Per position p, the bytes of activations made before ``order[p]`` and used from it on."""
    position = {n: i for i, n in enumerate(order)}
    last_use = {}
    for i, node in enumerate(order):
        for arg in _node_args(node):
            last_use[arg] = i
    for node in order:  # results the graph returns live to the end
        if any(u.op == "output" for u in node.users):
            last_use[node] = len(order)
    crossing = [0] * (len(order) + 1)
    for node, last in last_use.items():
        if node.name not in storage_of:
            continue
        first = position.get(node, -1) + 1  # graph inputs cross every cut up to their last use
        for p in range(first, last + 1 if last < len(order) else len(order) + 1):
            crossing[p] += storage_of[node.name][1]
    return crossing


def _node_args(node: Node) -> list[Node]:
    return [a for a in pytree.tree_leaves((node.args, node.kwargs)) if isinstance(a, Node)]


class _SavedRecorder(Interpreter):
    """Runs the graph once with gradients; records, per node, the storages its ops save for
    backward (module state excluded), and which node produced each storage."""

    def __init__(self, gm: GraphModule) -> None:
        super().__init__(gm)
        # Module state (parameters, buffers, folded constants) is held anyway: not activations.
        self._parameters = {t.untyped_storage().data_ptr()
                            for t in (*gm.parameters(), *gm.buffers())}
        self._current = ""
        self._alive: list[Any] = []
        self.saved_by_node: dict[str, dict[int, int]] = {}
        self.producer: dict[int, str] = {}
        self.storage_of: dict[str, tuple[int, int]] = {}

    def record(self, inputs: Sequence[Any]) -> None:
        """Run once (the caller puts back what the run changes)."""
        try:
            with torch.enable_grad(), \
                    torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t):
                self.run(*inputs)
        finally:
            self._alive.clear()

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in self._parameters and storage.nbytes():
            self.saved_by_node.setdefault(self._current, {})[ptr] = storage.nbytes()
        return t

    def run_node(self, n: Node) -> Any:
        self._current = n.name
        result = super().run_node(n)
        # Held to the end of the run, so no two storages share a pointer (their id here).
        self._alive.append(result)
        if isinstance(result, torch.Tensor) and n.op != "get_attr":
            storage = result.untyped_storage()
            ptr = storage.data_ptr()
            self.producer.setdefault(ptr, n.name)
            if ptr not in self._parameters:
                self.storage_of[n.name] = (ptr, storage.nbytes())
        return result
