"""The Backend protocol: an engine is one module of ``autoopt.backends`` holding ``BACKEND`` and
one name in ``autoopt.options.backends.BACKENDS``; both compile paths offer it their graphs and
the measured choice verifies what it builds, like every other candidate."""

from __future__ import annotations

import importlib
import sys
import types
from typing import Any

import pytest
import torch
from torch import nn

import autoopt
from autoopt.backends import BACKENDS, backend, offers
from autoopt.backends.base import Backend, Lowering, Subgraph, WholeGraph
from autoopt.options import backends as names
from autoopt.options import config as config_module
from autoopt.options.config import OptimizeConfig


def small() -> tuple[nn.Module, tuple[torch.Tensor]]:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 8)).eval(), \
        (torch.randn(4, 16),)


@pytest.mark.parametrize("name", BACKENDS)
def test_every_listed_backend_is_a_module_holding_its_backend(name: str) -> None:
    engine = backend(name)
    assert isinstance(engine, Backend)
    assert engine.name == name
    assert importlib.import_module(f"autoopt.backends.{name}").BACKEND is engine


def test_an_unknown_name_is_refused_with_the_list() -> None:
    with pytest.raises(ValueError, match="onnxruntime"):
        backend("tensorrt")


def install(monkeypatch: pytest.MonkeyPatch, engine: Backend) -> None:
    """What adding an engine is: its module, and its name in the list."""
    module = types.ModuleType(f"autoopt.backends.{engine.name}")
    module.BACKEND = engine  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, module.__name__, module)
    listed = (*BACKENDS, engine.name)
    for where in (names, config_module, importlib.import_module("autoopt.backends")):
        monkeypatch.setattr(where, "BACKENDS", listed)


class Replaying(Backend):
    """An engine that runs the portable graph, optionally off by ``error``."""

    def __init__(self, name: str, error: float = 0.0) -> None:
        self.name, self.error, self.offered = name, error, []

    def whole_graph(self, graph: WholeGraph) -> Lowering:
        self.offered.append(graph)
        source, error = graph.source, self.error

        def build() -> Any:
            run = graph.call(source)
            return lambda *a, **k: run(*a, **k)[0] + error if error else run(*a, **k)

        return Lowering(self.name, build)


def test_a_new_engine_is_offered_the_graph_built_verified_and_measured(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    engine = Replaying("replay")
    install(monkeypatch, engine)
    model, args = small()
    fast = autoopt.optimize(model, args, backends=("aten", "replay"))
    (choice,) = fast.report.backends
    assert [g.source is not None for g in engine.offered] == [True]
    assert set(choice.seconds) == {"aten", "replay"}  # both verified and timed
    torch.testing.assert_close(fast(*args), model(*args))


def test_a_new_engine_that_computes_another_function_is_skipped_with_the_reason(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    install(monkeypatch, Replaying("offset", error=1.0))
    model, args = small()
    fast = autoopt.optimize(model, args, backends=("aten", "offset"))
    (choice,) = fast.report.backends
    assert choice.chosen == "aten"
    assert "differs from eager" in choice.skipped["offset"]
    torch.testing.assert_close(fast(*args), model(*args))


def test_an_engine_that_declines_a_graph_says_why_in_the_report(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))

    class Declining(Backend):
        name = "declining"

        def whole_graph(self, graph: WholeGraph) -> str:
            return "takes int8 graphs only"

    install(monkeypatch, Declining())
    model, args = small()
    fast = autoopt.optimize(model, args, backends=("aten", "declining"))
    (choice,) = fast.report.backends
    assert choice.skipped["declining"] == "takes int8 graphs only"
    assert "takes int8 graphs only" in str(fast.report)


def test_a_dynamo_subgraph_is_offered_to_each_backend_and_the_others_say_why() -> None:
    model, args = small()
    gm = torch.fx.symbolic_trace(model)
    graph = Subgraph(gm, list(args), list(args), OptimizeConfig(), gradients=False)
    lowerings, skipped = offers(BACKENDS, "subgraph", graph)
    assert [lw.name for lw in lowerings][:1] == ["aten"]
    assert set(skipped) | {lw.name for lw in lowerings} == set(BACKENDS)
    assert "Python runs in between" in skipped["onnxruntime"]
    assert lowerings[0].build() is gm  # aten runs the verified subgraph itself
