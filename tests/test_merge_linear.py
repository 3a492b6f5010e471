"""merge_linear: sibling linears on one input into one wide matmul and a split."""

from __future__ import annotations

import operator
from pathlib import Path

import torch
from torch import nn
from torch.fx import GraphModule

from autoopt.capture.graph import export_graph
from autoopt.cost_model import CostCache, CostModel
from autoopt.passes import PassContext, merge_linear

aten = torch.ops.aten


class Before(nn.Module):
    """x ─┬─ q ─┐
          ├─ k ─┼─ softmax(q kᵀ) v ─ y      (the Q/K/V projections of attention)
          └─ v ─┘"""

    def __init__(self, d: int = 16, bias_v: bool = True) -> None:
        super().__init__()
        self.q, self.k = nn.Linear(d, d), nn.Linear(d, d)
        self.v = nn.Linear(d, 2 * d, bias=bias_v)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.q(x), self.k(x), self.v(x)
        return torch.softmax(q @ k.transpose(-1, -2), -1) @ v.view(*v.shape[:-1], 2, -1)[..., 0, :]


class Expected(nn.Module):
    """What merge_linear should leave of Before: one linear, one split."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.qkv = nn.Linear(d, 4 * d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = torch.split(self.qkv(x), [16, 16, 32], -1)
        return torch.softmax(q @ k.transpose(-1, -2), -1) @ v.view(*v.shape[:-1], 2, -1)[..., 0, :]


def _targets(gm: GraphModule) -> list[object]:
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def _export(model: nn.Module, x: torch.Tensor) -> GraphModule:
    with torch.no_grad():
        return export_graph(model.eval(), (x,), {})


def test_before_becomes_expected() -> None:
    x = torch.randn(2, 5, 16)
    result = merge_linear(_export(Before(), x), PassContext())  # no cost model: always merge
    assert result.counts == {"merged_groups": 1, "merged_linears": 3}
    expected = _export(Expected(), x)
    assert [t for t in _targets(result.graph_module) if t is not operator.getitem] == \
        [t for t in _targets(expected) if t is not operator.getitem]


def test_matches_eager_with_and_without_biases() -> None:
    for bias_v in (True, False):
        model = Before(bias_v=bias_v).eval()
        gm = _export(model, torch.randn(2, 5, 16))
        assert merge_linear(gm, PassContext()).modified
        gm.graph.lint()
        for _ in range(3):
            x = torch.randn(2, 5, 16)
            with torch.no_grad():
                torch.testing.assert_close(gm(x), model(x), rtol=1e-5, atol=1e-5)


def test_leaves_alone_a_single_linear_or_different_inputs() -> None:
    class Separate(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

        def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return self.a(x) + self.b(y) + self.a(y * 2)

    with torch.no_grad():
        gm = export_graph(Separate().eval(), (torch.randn(3, 8), torch.randn(3, 8)), {})
    assert not merge_linear(gm, PassContext()).modified


def test_leaves_alone_a_weight_that_is_an_input() -> None:
    class InputWeight(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(8, 8)

        def forward(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
            return self.a(x) + nn.functional.linear(x, w)

    with torch.no_grad():
        gm = export_graph(InputWeight().eval(), (torch.randn(3, 8), torch.randn(8, 8)), {})
    assert not merge_linear(gm, PassContext()).modified


def test_does_not_fire_when_gradients_are_needed() -> None:
    """The merged weight is a new constant: gradients would not reach the three parameters."""
    gm = export_graph(Before(), (torch.randn(2, 5, 16),), {})
    assert not merge_linear(gm, PassContext(training=True)).modified


def test_the_cost_model_decides(tmp_path: Path) -> None:
    cache = CostCache(tmp_path / "costs.json")
    gm = _export(Before(), torch.randn(2, 5, 16))
    result = merge_linear(gm, PassContext(cost=CostModel("cpu", cache=cache)))
    [(key, seconds)] = [(k, v) for k, v in cache.items() if k.startswith("fastest|linear_group")]
    assert set(seconds) == {"merged", "separate"}
    merged = seconds["merged"] <= seconds["separate"]
    assert result.modified == merged
    assert (aten.split_with_sizes.default in _targets(gm)) == merged
