"""A backend choice predicted from similar graphs measured on this machine (issue 49, item 3):
candidates that measured well behind the winner on every similar graph are not built, unless
the winner's time here doubts the prediction; what was predicted out is reported and kept in
the graph's record. Candidates are spin loops of known length, so the outcome does not depend
on the machine; one test runs the whole optimize on a real model."""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
from torch import nn

import autoopt
from autoopt.backends import prediction
from autoopt.backends.choice import Lowering, choose_backend
from autoopt.backends.prediction import GraphKind, Predictor
from autoopt.cost_model import CostCache, CostModel

from .checks import cost_model, spin


@pytest.fixture(autouse=True)
def _predicting(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(prediction, "ENABLED", True)




def kind(graph: str, flops: float = 1e9, nodes: int = 100) -> GraphKind:
    return GraphKind("fp32|grad=False|dynamic=False|conv", flops, nodes, graph)


class Engines:
    """Three candidates of known speed (ms) against an 8 ms eager; records what was built."""

    def __init__(self, cost: CostModel, **ms: float) -> None:
        self.cost, self.ms, self.built, self.calls = cost, ms, [], []

    def lowering(self, name: str, dominated_by: tuple[str, str] | None = None) -> Lowering:
        def build() -> Any:
            self.built.append(name)
            return spin(self.ms[name] / 1e3, self.calls, name)
        return Lowering(name, build, verified=True, dominated_by=dominated_by)

    def choose(self, graph: GraphKind, *, required: bool = False, eager_ms: float = 8.0,
               names: tuple[str, ...] = ("aten", "hybrid", "onnxruntime")) -> Any:
        self.built.clear()
        lowerings = [self.lowering(n) for n in names]
        return choose_backend("whole graph", lowerings, {}, verify=None,
                              timer=lambda run: run, cost_model=self.cost, what=graph.graph,
                              required=required, gradients=False,
                              reference=spin(eager_ms / 1e3, self.calls, "eager"),
                              predictor=Predictor(self.cost, graph))[1]




def test_candidates_far_behind_on_a_similar_graph_are_not_built(tmp_path: Any) -> None:
    engines = Engines(cost_model(tmp_path), aten=6.0, hybrid=5.8, onnxruntime=2.0)
    first = engines.choose(kind("g1"))
    assert first.chosen == "onnxruntime" and set(first.seconds) == {"aten", "hybrid",
                                                                    "onnxruntime"}
    assert engines.built == ["aten", "hybrid", "onnxruntime"]
    # A graph of the same kind, 1.5x the FLOPs: only the predicted winner is built, and timed
    # against eager once (the cheap check).
    second = engines.choose(kind("g2", flops=1.5e9))
    assert engines.built == ["onnxruntime"] and second.chosen == "onnxruntime"
    assert set(second.seconds) == {"onnxruntime"} and second.eager_s is not None
    found = re.match(r"predicted out: it measured ([0-9.]+)x onnxruntime's time",
                     second.skipped["aten"])
    assert found and 2.5 < float(found.group(1)) < 3.5  # 6 ms against 2 ms
    assert "predicted out" in second.describe()
    # Its record serves the next optimize of that graph: the left-out are not tried again.
    third = engines.choose(kind("g2", flops=1.5e9))
    assert third.cached and engines.built == ["onnxruntime"]
    assert "predicted out" in third.skipped["hybrid"]


def test_a_close_candidate_and_one_never_measured_are_built(tmp_path: Any) -> None:
    engines = Engines(cost_model(tmp_path), aten=6.0, hybrid=2.2, onnxruntime=2.0,
                      openvino=3.0)
    engines.choose(kind("g1"), names=("aten", "hybrid", "onnxruntime"))
    engines.choose(kind("g2"), names=("aten", "hybrid", "onnxruntime", "openvino"))
    assert engines.built == ["hybrid", "onnxruntime", "openvino"]  # aten alone left out


def test_a_winner_slower_here_than_a_left_out_candidate_was_brings_the_others_back(
        tmp_path: Any) -> None:
    engines = Engines(cost_model(tmp_path), aten=6.0, hybrid=4.0, onnxruntime=2.0)
    engines.choose(kind("g1"))
    engines.ms["onnxruntime"] = 7.9  # this graph is not one onnxruntime runs well
    choice = engines.choose(kind("g2"))
    assert engines.built == ["onnxruntime", "aten", "hybrid"]
    assert choice.chosen == "hybrid" and not any("predicted" in w for w in
                                                  choice.skipped.values())


def test_graphs_not_similar_and_shared_measurements_predict_nothing(
        tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from autoopt.cost_model import model as model_module

    from .checks import simulated_watch

    engines = Engines(cost_model(tmp_path), aten=6.0, hybrid=5.8, onnxruntime=2.0)
    monkeypatch.setattr(model_module, "Watch", simulated_watch(1.0))
    engines.choose(kind("g0"))  # measured on a shared machine: not remembered
    monkeypatch.setattr(model_module, "Watch", simulated_watch(0.0))
    engines.choose(kind("g1"))
    assert len(engines.built) == 3
    engines.choose(kind("g2", flops=4e9))  # 4x the FLOPs
    assert len(engines.built) == 3
    engines.choose(GraphKind("bf16|grad=False|dynamic=False|conv", 1e9, 100, "g3"))
    assert len(engines.built) == 3


def test_similar_graphs_that_disagree_predict_nothing(tmp_path: Any) -> None:
    cost = cost_model(tmp_path)
    for graph, ratios in (("g1", {"aten": 0.9, "onnxruntime": 0.3}),
                          ("g2", {"aten": 0.2, "onnxruntime": 0.3})):
        cost.remember_similar(kind(graph).kind, {"graph": graph, "flops": 1e9, "nodes": 100,
                                                 "ratios": ratios})
    assert Predictor(cost, kind("g3")).predict(["aten", "onnxruntime"]) is None
    assert len(Predictor(cost, kind("g1")).similar()) == 2  # the entries are found


def test_a_dominated_candidate_goes_with_the_one_it_can_only_tie(tmp_path: Any) -> None:
    cost = cost_model(tmp_path)
    predictor = Predictor(cost, kind("g2"))
    cost.remember_similar(kind("g1").kind, {"graph": "g1", "flops": 1e9, "nodes": 100,
                                            "ratios": {"aten": 0.8, "hybrid": 0.75,
                                                       "onnxruntime": 0.3}})
    found = predictor.predict(["aten", "hybrid", "inductor", "onnxruntime"],
                              {"inductor": "hybrid"})
    assert found is not None and found.winner == "onnxruntime"
    assert set(found.out) == {"aten", "hybrid", "inductor"}
    assert "at most tie hybrid" in found.out["inductor"]
    assert found.doubt("onnxruntime", 0.5) == "" and "slower than" in found.doubt(
        "onnxruntime", 0.9)


def test_a_graphs_kind_names_the_op_classes_that_carry_its_flops(tmp_path: Any) -> None:
    cost = CostModel(cache=CostCache(tmp_path / "costs.json"))
    cnn = nn.Sequential(nn.Conv2d(3, 16, 3), nn.ReLU(), nn.Conv2d(16, 16, 3)).eval()
    mlp = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64)).eval()
    kinds = {}
    for name, model, x in (("cnn", cnn, torch.randn(1, 3, 32, 32)),
                           ("mlp", mlp, torch.randn(4, 64))):
        gm = torch.export.export(model, (x,)).module()
        found = GraphKind.of(cost, gm, precision=None, gradients=False, dynamic=False,
                             graph=name)
        assert found is not None and found.flops > 0
        kinds[name] = found
    assert kinds["cnn"].kind.endswith("|conv") and kinds["mlp"].kind.endswith("|matmul")
    assert kinds["cnn"].near({"flops": kinds["cnn"].flops * 1.9, "nodes": kinds["cnn"].nodes})
    assert not kinds["cnn"].near({"flops": kinds["cnn"].flops * 2.5,
                                  "nodes": kinds["cnn"].nodes})
    assert not kinds["cnn"].near({"flops": "garbled"})


def test_optimize_leaves_out_what_a_similar_graph_measured_far_behind(
        tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # no other test's similar graphs
    model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64)).eval()
    backends = ("aten", "onnxruntime")
    with torch.no_grad():
        first = autoopt.optimize(model, (torch.randn(4, 64),), backends=backends)
        choice = first.report.backends[0]
        assert set(choice.seconds) == set(backends)
        # Make the first graph's record say that one candidate ran far behind the other.
        cache = CostCache.default()
        key, entry = next((k, v) for k, v in cache.items() if k.startswith("similar|")
                          and "|matmul|" in k and v["choices"][-1]["ratios"].keys()
                          == set(backends))
        last = entry["choices"][-1]
        slow = "onnxruntime" if choice.chosen == "aten" else "aten"
        last["ratios"] = {choice.chosen: 0.01, slow: 100.0}
        cache.put(key, entry)
        second = autoopt.optimize(model, (torch.randn(6, 64),), backends=backends)
        x = torch.randn(6, 64)
        torch.testing.assert_close(second(x), model(x))
    again = second.report.backends[0]
    assert again.chosen == choice.chosen and set(again.seconds) == {choice.chosen}
    assert again.skipped[slow].startswith("predicted out")
    assert f"not {slow}: predicted out" in str(second.report)
