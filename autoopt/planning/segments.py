"""The forward graph's segments, the modes a memory plan gives them, and what a choice of modes
costs: the most saved-activation bytes alive at once, and the time it adds to a step.

For each segment a plan chooses what happens to the tensors its ops save for backward:

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
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

KEEP, OFFLOAD, SELECTIVE, RECOMPUTE = "keep", "offload", "selective", "recompute"
MODES: tuple[str, ...] = (KEEP, OFFLOAD, SELECTIVE, RECOMPUTE)


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


# --- the cost of a plan --------------------------------------------------------------------


class Storages:
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
    return Storages(segments).peak(modes)


def added_seconds(segments: Sequence[Segment], modes: Sequence[str], bandwidth: float,
                  overlap: bool) -> list[float]:
    """Per segment, the predicted time its mode adds to a training step."""
    costs = []
    for i, (seg, mode) in enumerate(zip(segments, modes, strict=True)):
        if mode in (RECOMPUTE, SELECTIVE):
            costs.append(seg.rerun_seconds(mode))
        elif mode == OFFLOAD:
            costs.append(offload_seconds(segments, i, bandwidth, overlap))
        else:
            costs.append(0.0)
    return costs


def offload_seconds(segments: Sequence[Segment], i: int, bandwidth: float,
                    overlap: bool) -> float:
    """The time offloading segment ``i`` adds: its copies out and back, less what compute
    hides."""
    copy = segments[i].saved_bytes / bandwidth if bandwidth > 0 else math.inf
    if not overlap:
        return 2 * copy
    # The copy out hides behind the next segment's forward; the copy back (prefetched when
    # the next segment's backward starts) behind that backward, about twice its forward.
    window = segments[i + 1].forward_s if i + 1 < len(segments) else 0.0
    return max(0.0, copy - window) + max(0.0, copy - 2 * window)
