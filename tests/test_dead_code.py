"""dead_code: erase unused pure nodes, keep in-place updates and guards."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from autoopt.capture.graph import export_graph, symbolic_trace_graph
from autoopt.passes import PassContext, eliminate_dead_code
from autoopt.passes.graph import is_impure

aten = torch.ops.aten


class Before(nn.Module):
    """x ─ sin ─ y, with cos(x) computed and dropped."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        unused = x.cos()  # noqa: F841 - the dead branch under test
        return x.sin()


def test_removes_unused_nodes_and_keeps_the_function() -> None:
    x = torch.randn(5)
    gm = export_graph(Before(), (x,), {})
    result = eliminate_dead_code(gm, PassContext())
    targets = [n.target for n in result.graph_module.graph.nodes if n.op == "call_function"]
    assert targets == [aten.sin.default]
    assert result.counts == {"dead_nodes": 1}
    y = torch.randn(5)
    torch.testing.assert_close(result.graph_module(y), y.sin())


def test_keeps_batchnorm_statistics_updates_in_training() -> None:
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)).train()
    x = torch.randn(2, 3, 8, 8)
    gm = export_graph(model, (x,), {})
    gm = eliminate_dead_code(gm, PassContext()).graph_module
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert aten.add_.Tensor in targets  # num_batches_tracked += 1 has no users but must stay
    before = gm.get_buffer("1.running_mean").clone()
    gm(x)
    assert not torch.equal(gm.get_buffer("1.running_mean"), before)
    assert int(gm.get_buffer("1.num_batches_tracked")) == 1


class Stateful(nn.Module):
    """Writes whose results nobody reads, as torch-level graphs (Dynamo, symbolic_trace) spell
    them: methods, ``*_`` functions, ``inplace=`` and ``out=``, a training BatchNorm."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("count", torch.zeros((), dtype=torch.long))
        self.register_buffer("ema", torch.zeros(3))
        self.bn = nn.BatchNorm1d(3)
        self.stats = nn.BatchNorm1d(3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.count.add_(1)
        self.ema.mul_(0.9).add_(x.mean(0), alpha=0.1)
        F.batch_norm(x, self.stats.running_mean, self.stats.running_var, training=True)
        self.bn(x)
        h = x - 0.5
        torch.relu_(h)
        F.hardtanh(h, -0.2, 0.2, True)
        torch.mul(h, 2, out=h)
        return h


def _dead_code_backend(gm: torch.fx.GraphModule, example_inputs: list[object]) -> Callable:
    return eliminate_dead_code(gm, PassContext()).graph_module


def _symbolic_trace_with_dead_code(model: nn.Module, x: torch.Tensor,
                                   ) -> Callable[[torch.Tensor], torch.Tensor]:
    gm, _ = symbolic_trace_graph(model, (x,), {})
    return eliminate_dead_code(gm, PassContext()).graph_module


@pytest.mark.parametrize("capture", ["dynamo", "symbolic_trace"])
def test_keeps_in_place_writes_at_torch_function_level(capture: str) -> None:
    model, twin = Stateful().train(), Stateful().train()
    torch._dynamo.reset()
    xs = [torch.randn(4, 3) for _ in range(3)]
    run = (torch.compile(model, backend=_dead_code_backend) if capture == "dynamo"
           else _symbolic_trace_with_dead_code(model, xs[0]))
    for x in xs:
        torch.testing.assert_close(run(x), twin(x))
    for name, value in twin.state_dict().items():
        torch.testing.assert_close(model.state_dict()[name], value, msg=name)


class DeadPure(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.bn = nn.BatchNorm1d(3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.bn(x)  # eval mode: reads its statistics, writes nothing
        unused = x.cos()  # noqa: F841 - the dead branch under test
        return x.sin()


def test_removes_unused_eval_modules_and_functions_at_torch_function_level() -> None:
    gm = torch.fx.symbolic_trace(DeadPure().eval())
    result = eliminate_dead_code(gm, PassContext())
    ops = [(n.op, n.target) for n in result.graph_module.graph.nodes
           if n.op in ("call_module", "call_method", "call_function")]
    assert ops == [("call_method", "sin")]
    assert result.counts == {"dead_nodes": 2}


@pytest.mark.parametrize(("expression", "impure"), [
    ("x.add_(1)", True),
    ("x.__iadd__(1)", True),
    ("torch.relu_(x)", True),
    ("F.relu(x, True)", True),
    ("F.relu(x, inplace=True)", True),
    ("torch.add(x, 1, out=x)", True),
    ("F.batch_norm(x, m, v, training=True)", True),
    ("F.batch_norm(x, m, v, training=False)", False),
    ("F.batch_norm(x, None, None, training=True)", False),
    ("x.add(1)", False),
    ("F.relu(x)", False),
])
def test_is_impure_at_torch_function_level(expression: str, impure: bool) -> None:
    class One(nn.Module):
        def forward(self, x: torch.Tensor, m: torch.Tensor, v: torch.Tensor) -> None:
            eval(expression, {"torch": torch, "F": F}, {"x": x, "m": m, "v": v})  # noqa: S307

    gm = torch.fx.symbolic_trace(One())
    (node,) = [n for n in gm.graph.nodes if n.op in ("call_method", "call_function")]
    assert is_impure(node) is impure
