"""A new input size reuses what the module's first graph measured (issue 47, item 3): the backend
that won is the one candidate built for the new graph, the passes that did not apply stay off,
and where that backend starts from the graph before autoopt's lowerings, those too; the new
graph is still verified against eager. A first choice measured on a shared machine is not
reused. The machine's load is simulated quiet or busy (tests/test_contention.py tests how it is
read), so these hold on a busy CI machine too."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import autoopt
from autoopt.backends import onnxruntime as ort
from autoopt.cost_model import model as model_module
from autoopt.passes import LOWERING

from .checks import simulated_watch

QUIET, BUSY = simulated_watch(0.0), simulated_watch(1.0)


def cnn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                         nn.Conv2d(16, 16, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                         nn.Flatten(), nn.Linear(16, 10)).eval()


@pytest.fixture
def builds(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> list[str]:
    """The ONNX Runtime lowerings built (each with a fresh autoopt cache)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    made: list[str] = []
    real = ort.lower

    def lower(*a: Any, **k: Any) -> Any:
        made.append("onnxruntime")
        return real(*a, **k)

    monkeypatch.setattr(ort, "lower", lower)
    return made


def test_a_new_size_builds_only_the_backend_the_first_graph_measured_fastest(
        builds: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(model_module, "Watch", QUIET)
    model = cnn()
    fast = autoopt.optimize(model, (torch.randn(1, 3, 16, 16),),
                            backends=("aten", "onnxruntime"))
    first = fast.report.captures[0].backends[0]
    assert set(first.seconds) == {"aten", "onnxruntime"} and builds == ["onnxruntime"]
    x = torch.randn(4, 3, 16, 16)
    with torch.no_grad():
        torch.testing.assert_close(fast(x), model(x), rtol=1e-4, atol=1e-5)
    second = fast.report.captures[1]
    (choice,) = second.backends
    assert choice.chosen == first.chosen and choice.seconds == {}  # nothing measured
    other = ({"aten", "onnxruntime"} - {first.chosen}).pop()
    assert "not measured for these inputs" in choice.skipped[other]
    assert builds.count("onnxruntime") == 1 + (first.chosen == "onnxruntime")
    assert second.verification is not None and second.verification.ok
    status = {r.name: r.status for r in second.passes}
    idle = {r.name for r in fast.report.captures[0].passes if r.status != "applied"}
    assert all(status[name] == "disabled" for name in idle)
    if first.chosen == "onnxruntime":  # it starts from the graph before the lowerings
        assert all(status[name] == "disabled" for name in LOWERING & set(status))
    assert "not measured for these inputs" in str(fast.report)


def test_a_first_choice_measured_on_a_shared_machine_is_not_reused(
        builds: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(model_module, "Watch", BUSY)
    model = cnn()
    fast = autoopt.optimize(model, (torch.randn(1, 3, 16, 16),),
                            backends=("aten", "onnxruntime"))
    assert fast.report.captures[0].backends[0].shared
    monkeypatch.setattr(model_module, "Watch", QUIET)
    x = torch.randn(4, 3, 16, 16)
    with torch.no_grad():
        torch.testing.assert_close(fast(x), model(x), rtol=1e-4, atol=1e-5)
    (choice,) = fast.report.captures[1].backends
    assert set(choice.seconds) == {"aten", "onnxruntime"}  # measured anew
    assert builds == ["onnxruntime", "onnxruntime"]


def test_where_the_first_graphs_winner_cannot_build_the_new_one_the_aten_graph_runs(
        builds: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    from autoopt.backends import choice as choice_lib

    monkeypatch.setattr(model_module, "Watch", QUIET)
    # The measurement pinned: the later candidate, onnxruntime, wins.
    monkeypatch.setattr(choice_lib, "replaces", lambda seconds, best: True)
    model = cnn()
    fast = autoopt.optimize(model, (torch.randn(1, 3, 16, 16),),
                            backends=("aten", "onnxruntime"))
    assert fast.report.captures[0].backends[0].chosen == "onnxruntime"
    monkeypatch.setattr(ort, "available", lambda: "onnxruntime went away")
    x = torch.randn(4, 3, 16, 16)
    with torch.no_grad():
        torch.testing.assert_close(fast(x), model(x), rtol=1e-4, atol=1e-5)
    (choice,) = fast.report.captures[1].backends
    assert choice.chosen == "aten" and choice.seconds == {}
    assert "onnxruntime went away" in choice.skipped["onnxruntime"]
    assert "aten" not in choice.skipped  # it runs the graph: not "not measured"
