"""A candidate with a bound on its time (``Lowering.at_best``: hybrid runs aten's kernels, so it
is at best aten's time less the regions between them) is built after the others and only where
that bound beats the fastest of them (issue 49, item 3: an Inductor compile is not spent where
it cannot win). Candidates are spin loops of known length; one test runs optimize."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import autoopt
from autoopt.backends import hybrid
from autoopt.backends.choice import Lowering, choose_backend
from autoopt.backends.prediction import GraphKind, Predictor

from .checks import cost_model, spin


class Engines:
    """aten, hybrid (bounded by ``share`` of aten's time), inductor (at most ties hybrid) and
    onnxruntime, of known speed (ms) against an 8 ms eager."""

    def __init__(self, tmp_path: Path, share: float, **ms: float) -> None:
        self.cost = cost_model(tmp_path)
        self.share, self.ms, self.built, self.calls = share, ms, [], []

    def lowering(self, name: str, **extra: Any) -> Lowering:
        def build() -> Any:
            self.built.append(name)
            return spin(self.ms[name] / 1e3, self.calls, name)
        return Lowering(name, build, verified=True, **extra)

    def choose(self, predictor: Predictor | None = None, reads: bool = False) -> Any:
        self.built.clear()

        def bound(ratios: Any) -> tuple[float, str] | None:
            return (ratios["aten"] * self.share, "a share") if "aten" in ratios else None

        if reads:
            bound.reads = "aten"  # type: ignore[attr-defined]

        lowerings = [self.lowering("aten"), self.lowering("hybrid", at_best=bound),
                     self.lowering("inductor", dominated_by=("hybrid", "it ties hybrid")),
                     self.lowering("onnxruntime")]
        return choose_backend("whole graph", lowerings, {}, verify=None,
                              timer=lambda run: run, cost_model=self.cost, what="g",
                              required=False, gradients=False,
                              reference=spin(0.008, self.calls, "eager"), predictor=predictor)[1]


def test_a_candidate_whose_bound_cannot_beat_the_fastest_is_not_built(tmp_path: Path) -> None:
    engines = Engines(tmp_path, share=0.95, aten=6.0, hybrid=5.8, inductor=7.0, onnxruntime=2.0)
    choice = engines.choose()
    assert engines.built == ["aten", "onnxruntime"] and choice.chosen == "onnxruntime"
    assert choice.skipped["hybrid"].startswith("not built: at best 0.7")  # 0.95 * 6 / 8
    assert "not faster than onnxruntime's 0.2" in choice.skipped["hybrid"]
    assert "at most tie hybrid" in choice.skipped["inductor"]
    # The record serves the next optimize: neither is tried again.
    again = engines.choose()
    assert again.cached and engines.built == ["onnxruntime"]
    assert again.skipped["hybrid"].startswith("not built: at best")


def test_a_candidate_whose_bound_may_win_is_built_after_the_others(tmp_path: Path) -> None:
    engines = Engines(tmp_path, share=0.3, aten=6.0, hybrid=1.5, inductor=7.0, onnxruntime=2.0)
    choice = engines.choose()
    assert engines.built == ["aten", "onnxruntime", "hybrid"]  # inductor: it ties hybrid
    assert choice.chosen == "hybrid" and set(choice.seconds) == {"aten", "onnxruntime",
                                                                 "hybrid"}


def test_a_bound_is_remembered_for_similar_graphs_as_the_least_that_candidate_takes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from autoopt.backends import prediction

    monkeypatch.setattr(prediction, "ENABLED", True)
    engines = Engines(tmp_path, share=0.95, aten=6.0, hybrid=5.8, inductor=7.0, onnxruntime=2.0)
    kind = GraphKind("fp32|grad=False|dynamic=False|conv", 1e9, 100, "g")
    engines.choose(Predictor(engines.cost, kind))
    ratios = engines.cost.similar(kind.kind)[-1]["ratios"]
    assert ratios["hybrid"] == pytest.approx(0.95 * ratios["aten"])
    found = Predictor(engines.cost, GraphKind(kind.kind, 1e9, 100, "g2")).predict(
        ["aten", "hybrid", "inductor", "onnxruntime"], {"inductor": "hybrid"})
    assert found is not None and set(found.out) == {"aten", "hybrid", "inductor"}


def test_a_prediction_keeps_the_candidate_a_bound_reads(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from autoopt.backends import prediction

    monkeypatch.setattr(prediction, "ENABLED", True)
    engines = Engines(tmp_path, share=0.95, aten=6.0, hybrid=5.8, inductor=7.0, onnxruntime=4.0)
    kind = GraphKind("fp32|grad=False|dynamic=False|conv", 1e9, 100, "g")
    # A similar graph: aten far behind onnxruntime, hybrid close to it.
    engines.cost.remember_similar(kind.kind, {"graph": "g0", "flops": 1e9, "nodes": 100,
                                              "ratios": {"aten": 0.75, "hybrid": 0.55,
                                                         "onnxruntime": 0.5}})
    choice = engines.choose(Predictor(engines.cost, kind), reads=True)
    assert engines.built == ["aten", "onnxruntime"]  # aten for hybrid's bound, which rules it out
    assert choice.skipped["hybrid"].startswith("not built: at best")
    assert "aten" in choice.seconds and choice.chosen == "onnxruntime"


def test_hybrids_bound_is_aten_time_times_its_kernels_share(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    bounds: list[tuple[float, float | None]] = []
    real = hybrid._AtBest.__call__

    def seen(self: Any, ratios: Any) -> Any:
        found = real(self, ratios)
        bounds.append((ratios.get("aten", 0.0), found[0] if found else None))
        return found

    monkeypatch.setattr(hybrid._AtBest, "__call__", seen)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 32, 3, padding=1), nn.GELU(), nn.BatchNorm2d(32),
                          nn.Conv2d(32, 32, 3, padding=1), nn.Tanh()).eval()
    x = torch.randn(1, 3, 32, 32)
    with torch.no_grad():
        fast = autoopt.optimize(model, (x,), backends=("aten", "hybrid"))
        torch.testing.assert_close(fast(x), model(x), atol=1e-4, rtol=1e-4)
    choice = fast.report.backends[0]
    if "hybrid" in choice.skipped and not bounds:  # no autoopt kernel chosen, no Inductor
        pytest.skip(f"hybrid not offered here: {choice.skipped['hybrid']}")
    assert bounds, choice.describe()
    aten, bound = bounds[-1]
    assert bound is not None and 0.0 < bound < aten  # the regions between kernels take some
    assert "hybrid" in fast.report.backends[0].seconds  # below aten's own time: built
