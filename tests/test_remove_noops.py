"""remove_noops: eval dropout, identity modules, x*1 / x+0, unchanged views and casts."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from autoopt.capture.graph import export_graph, symbolic_trace_graph
from autoopt.passes import PassContext, remove_noops

aten = torch.ops.aten


class Before(nn.Module):
    """x ─ linear ─ dropout ─ *1 ─ +0 ─ view(same) ─ to(float32) ─ relu ─ y"""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.dropout = nn.Dropout(0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.dropout(self.linear(x)) * 1 + 0
        y = y.view(y.shape).to(torch.float32)
        return torch.relu(y)


class Expected(nn.Module):
    """What remove_noops should leave of Before."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.linear(x))


def _targets(gm: torch.fx.GraphModule) -> list[object]:
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def test_before_becomes_expected_at_aten_level() -> None:
    x = torch.randn(4, 8)
    gm = export_graph(Before().eval(), (x,), {})
    result = remove_noops(gm, PassContext())
    expected = export_graph(Expected().eval(), (x,), {})
    assert result.modified
    assert result.counts == {"dropout": 1, "arithmetic": 2, "alias": 2, "assert": 1}
    assert _targets(result.graph_module) == _targets(expected)


def test_matches_eager_on_fresh_inputs() -> None:
    model = Before().eval()
    gm = remove_noops(export_graph(model, (torch.randn(4, 8),), {}), PassContext()).graph_module
    for _ in range(3):
        x = torch.randn(4, 8)
        torch.testing.assert_close(gm(x), model(x), rtol=1e-5, atol=1e-6)


def test_module_level_graph_drops_eval_dropout_and_identity() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5), nn.Identity(), nn.ReLU()).eval()
    x = torch.randn(2, 4)
    gm, positional = symbolic_trace_graph(model, (x,), {})
    result = remove_noops(gm, PassContext())
    assert result.counts == {"dropout": 1, "identity": 1}
    kinds = [type(gm.get_submodule(n.target)) for n in gm.graph.nodes if n.op == "call_module"]
    assert kinds == [nn.Linear, nn.ReLU]
    torch.testing.assert_close(gm(*positional(x)), model(x))


def test_functional_dropout_with_training_false_is_removed() -> None:
    class M(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return F.dropout(x, 0.5, training=False).sin()

    gm, _ = symbolic_trace_graph(M(), (torch.randn(3),), {})
    assert remove_noops(gm, PassContext()).counts == {"dropout": 1}


def test_does_not_fire_on_dropout_in_train_mode() -> None:
    model = Before().train()
    gm = export_graph(model, (torch.randn(4, 8),), {})
    result = remove_noops(gm, PassContext())
    assert aten.dropout.default in _targets(result.graph_module)
    assert "dropout" not in result.counts


def test_does_not_fire_when_the_type_changes_or_the_result_is_mutated() -> None:
    class M(nn.Module):
        def forward(self, ints: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
            promoted = ints * 1.0           # int64 -> float32: not a no-op
            copy = x + 0                    # a new tensor that is then written in place
            copy.add_(1)
            returned = x * 1                # returned directly: must stay a separate tensor
            return promoted, copy, returned

    ints, x = torch.arange(4), torch.randn(4)
    gm = export_graph(M(), (ints, x), {})
    result = remove_noops(gm, PassContext())
    assert not result.modified
    promoted, copy, returned = result.graph_module(ints, x)
    assert promoted.dtype == torch.float32
    torch.testing.assert_close(copy, x + 1)
    assert returned.data_ptr() != x.data_ptr()


def test_does_not_fire_on_views_that_change_shape() -> None:
    class M(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x.view(2, 8).permute(1, 0)[:, :1]

    gm = export_graph(M(), (torch.randn(4, 4),), {})
    assert not remove_noops(gm, PassContext()).modified



def test_does_not_fire_on_a_rounding_division() -> None:
    class M(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.div(x, 1, rounding_mode="floor").sin()  # floor(x), not x

    x = torch.randn(4) * 3
    gm, _ = symbolic_trace_graph(M(), (x,), {})
    assert not remove_noops(gm, PassContext()).modified
    torch.testing.assert_close(gm(x), torch.floor(x).sin())


def test_does_not_fire_when_an_item_write_follows() -> None:
    class M(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            written = x * 1      # a new tensor: `written[0] = 5` must not write into x
            written[0] = 5.0
            return written.sin()

    graphs: list[torch.fx.GraphModule] = []

    def grab(gm: torch.fx.GraphModule, example_inputs: object) -> object:
        graphs.append(gm)  # Dynamo's graph: `operator.setitem` on the product
        return gm.forward

    torch._dynamo.reset()
    torch.compile(M(), backend=grab, fullgraph=True)(torch.randn(4))
    assert not remove_noops(graphs[0], PassContext()).modified
