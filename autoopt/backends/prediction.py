"""A graph's backend predicted from the choices measured on similar graphs on this machine.

Building every candidate is most of what a first ``optimize`` costs: resnet50 at batch 1 on a
2-vCPU Xeon spent 13 of its 21 s building and timing aten, hybrid, ONNX Runtime and OpenVINO,
where OpenVINO's own convert-and-compile takes about 3 s. Engines rank alike on graphs of one
kind, so each full measurement is remembered by the graph's kind (``GraphKind``: precision,
mode, which op classes carry the FLOPs), and a new graph of that kind whose FLOPs and node
count lie within 2x of a remembered one's is predicted from it:

- the winner, where every similar graph's choice agrees on it;
- left out ("predicted out"), each candidate that measured at least ``MARGIN`` slower than that
  winner on every similar graph. A candidate that was close, or that a similar graph did not
  measure, is built and measured as before.

The fastest of those built is then timed against eager (the cheap check). Where it runs
slower, over eager, than a left-out candidate ran on a similar graph (or none builds), the
prediction is doubted and the left-out candidates are built and measured too. Only full
measurements are remembered, and only those made on a quiet machine: a prediction never
feeds the next one.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from torch.fx import GraphModule

from autoopt.backends.choice import PREDICTED, decided
from autoopt.cost_model import CostModel, GraphCost

# How much slower than the predicted winner a candidate must have measured on every similar
# graph to be left out: well beyond one run's noise (1-3%) and the drift between graphs of one
# kind (resnet18 to resnet50, a batch of 1 to 2: the engines' ratios over eager move by 5-10%).
MARGIN = 0.15
# Off in the test suite, where every test's choice is measured among all its candidates (which
# tests ran before one must not change what it measures); tests of prediction turn it on.
ENABLED = True
# Op classes by what a node calls (an ATen op or, in a symbolic_trace graph, a module's class).
_CLASSES = (("attention", re.compile(r"scaled_dot_product|attention", re.I)),
            ("conv", re.compile(r"conv", re.I)),
            ("matmul", re.compile(r"\b(?:add)?b?mm\b|matmul|linear|einsum|addmm|baddbmm", re.I)))
# An op class names a graph's kind where it carries at least this share of the FLOPs.
_SHARE = 0.2


@dataclass(frozen=True)
class GraphKind:
    """What similar graphs share (``kind``), and where a graph of it lies (``flops``,
    ``nodes``); ``graph``: the graph's identity, which names its remembered entry."""

    kind: str
    flops: float
    nodes: int
    graph: str

    @classmethod
    def of(cls, cost_model: CostModel, source: GraphModule, *, precision: str | None,
           gradients: bool, dynamic: bool, graph: str,
           estimate: Callable[[], GraphCost] | None = None) -> GraphKind | None:
        """The kind of ``source`` (the graph other engines lower), or None where its costs
        cannot be estimated or it computes nothing measurable. ``estimate``: gives
        ``cost_model.predict(source)``, where the caller shares it."""
        try:
            costs = (estimate() if estimate is not None else cost_model.predict(source)).nodes
        except Exception:  # noqa: BLE001 - a prediction the choice can do without
            return None
        shares: dict[str, float] = {}
        for cost in costs:
            name = next((c for c, pattern in _CLASSES if pattern.search(cost.op)), "other")
            shares[name] = shares.get(name, 0.0) + cost.flops
        flops = sum(shares.values())
        if flops <= 0:
            return None
        classes = "+".join(sorted(c for c, f in shares.items() if f >= _SHARE * flops))
        kind = f"{precision or 'fp32'}|grad={gradients}|dynamic={dynamic}|{classes}"
        return cls(kind, float(flops), len(costs), graph)

    def near(self, entry: dict[str, Any]) -> bool:
        """Whether a remembered graph's FLOPs and node count lie within 2x of this one's."""
        try:
            return (abs(math.log2(float(entry["flops"]) / self.flops)) <= 1.0
                    and abs(math.log2(int(entry["nodes"]) / max(self.nodes, 1))) <= 1.0)
        except (KeyError, TypeError, ValueError, ZeroDivisionError):
            return False


@dataclass(frozen=True)
class Prediction:
    """The predicted ``winner``, the candidates left ``out`` (each with the report's reason),
    and ``ceiling``: the least time over eager a left-out candidate measured on a similar
    graph, which the winner must beat here for the prediction to stand."""

    winner: str
    out: dict[str, str]
    ceiling: float

    def doubt(self, kept: str | None, ratio: float | None) -> str:
        """Why the candidate kept here (None: none built) and its time over eager (None: not
        measured) do not bear the prediction out, or ""."""
        if kept is None or ratio is None:
            return f"{self.winner}, the predicted winner, was not built or not measured"
        if ratio > self.ceiling:
            return (f"{kept} measured {ratio:.2f}x eager's time, slower than a candidate left "
                    f"out ran on a similar graph ({self.ceiling:.2f}x)")
        return ""


class Predictor:
    """Predicts one graph's choice (``predict``) and remembers its full measurement
    (``remember``) among the choices made on graphs of its kind on this machine. ``kind``: the
    graph's, or what gives it (None: no kind), asked only when first needed: a choice served
    from its record needs none."""

    def __init__(self, cost_model: CostModel,
                 kind: GraphKind | Callable[[], GraphKind | None]) -> None:
        self.cost_model, self._kind = cost_model, kind

    @functools.cached_property
    def kind(self) -> GraphKind | None:
        return self._kind if isinstance(self._kind, GraphKind) else self._kind()

    def similar(self) -> list[dict[str, float]]:
        """Each similar graph's times over eager, by candidate."""
        if self.kind is None:
            return []
        found = []
        for entry in self.cost_model.similar(self.kind.kind):
            ratios = entry.get("ratios")
            if self.kind.near(entry) and isinstance(ratios, dict):
                clean = {str(n): float(r) for n, r in ratios.items()
                         if isinstance(r, (int, float)) and math.isfinite(r) and r > 0}
                if clean:
                    found.append(clean)
        return found

    def predict(self, order: Sequence[str],
                dominated: dict[str, str] | None = None) -> Prediction | None:
        """What the similar graphs' choices among ``order`` (the candidates, in order of
        preference) predict, or None where none is similar, they disagree, or none is left
        out. ``dominated`` maps a candidate to one it can at most tie (``Lowering.
        dominated_by``), which the similar graphs therefore did not measure: it is left out
        with that one."""
        if not ENABLED:
            return None
        similar = [{n: r for n, r in ratios.items() if n in order} for ratios in self.similar()]
        winners = {decided(order, ratios) for ratios in similar}
        if not similar or len(winners) != 1:
            return None
        winner = winners.pop()
        if winner is None:
            return None
        out: dict[str, str] = {}
        ceiling = math.inf
        for name in order:
            slower = [r[name] / r[winner] for r in similar if name in r]
            if name == winner or len(slower) < len(similar) or min(slower) < 1.0 + MARGIN:
                continue
            out[name] = (f"{PREDICTED}: it measured {min(slower):.2f}x {winner}'s time or "
                         f"more on {len(similar)} similar graph(s) here (same op classes and "
                         f"precision, FLOPs and node count within 2x)")
            ceiling = min(ceiling, *(r[name] for r in similar))
        for name, by in (dominated or {}).items():
            if by in out and name in order and name != winner and name not in out:
                out[name] = f"{PREDICTED}: it can at most tie {by}, which is predicted out"
        return Prediction(winner, out, ceiling) if out else None

    def remember(self, seconds: dict[str, float], eager_s: float,
                 bounds: dict[str, float] | None = None) -> None:
        """Store a full measurement: each candidate's ``seconds`` over eager's, and for one
        not built because it could not win, its bound over eager's (the least it could take:
        a prediction from it errs toward building it)."""
        ratios = {**(bounds or {}), **{n: s / eager_s for n, s in seconds.items()}}
        if self.kind is not None and eager_s > 0 and len(seconds) > 1:
            self.cost_model.remember_similar(self.kind.kind, {
                "graph": self.kind.graph, "flops": self.kind.flops, "nodes": self.kind.nodes,
                "ratios": ratios})
