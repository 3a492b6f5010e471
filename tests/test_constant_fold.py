"""constant_fold: what depends on no input is computed once and stored as a new buffer."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.fx import GraphModule

from autoopt.capture.graph import export_graph
from autoopt.passes import PassContext, constant_fold

aten = torch.ops.aten


class Before(nn.Module):
    """x ─ matmul(·, w.t() * 2) ─ add(·, exp(b)) ─ y"""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(6, 8))
        self.b = nn.Parameter(torch.randn(6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ (self.w.t() * 2) + self.b.exp()


class Expected(nn.Module):
    """What constant_fold should leave of Before: the constants as stored tensors."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("w2", torch.randn(8, 6))
        self.register_buffer("b2", torch.randn(6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.w2 + self.b2


def _targets(gm: GraphModule) -> list[object]:
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def test_before_becomes_expected() -> None:
    x = torch.randn(4, 8)
    result = constant_fold(export_graph(Before(), (x,), {}), PassContext())
    expected = export_graph(Expected(), (x,), {})
    assert result.modified and result.counts == {"constant_folded": 2}
    assert _targets(result.graph_module) == _targets(expected)
    attrs = [n for n in result.graph_module.graph.nodes if n.op == "get_attr"]
    assert len(attrs) == 2 and all(isinstance(n.meta["val"], torch.Tensor) for n in attrs)


def test_matches_eager_on_fresh_inputs_and_leaves_parameters_alone() -> None:
    model = Before()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    gm = constant_fold(export_graph(model, (torch.randn(4, 8),), {}), PassContext()).graph_module
    for _ in range(3):
        x = torch.randn(4, 8)
        torch.testing.assert_close(gm(x), model(x), rtol=1e-5, atol=1e-5)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())
    stored = [b for name, b in gm.named_buffers() if name.startswith("folded_constant")]
    assert not {b.untyped_storage().data_ptr() for b in stored} & {
        p.untyped_storage().data_ptr() for p in model.parameters()}


def test_folds_position_ids_and_casts() -> None:
    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("table", torch.randn(32, 4))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            positions = torch.arange(32)[: x.shape[1]]         # arange + slice: no input
            return x.double() + self.table.double()[positions].T

    model = M()
    x = torch.randn(4, 10)
    gm = export_graph(model, (x,), {})
    # Buffers need no gradient, so this folds even when the graph will be differentiated.
    result = constant_fold(gm, PassContext(training=True))
    assert result.counts == {"constant_folded": 1}
    folded = {aten.arange.default, aten.slice.Tensor, aten.index.Tensor, aten.numpy_T.default}
    assert not folded & set(_targets(gm))
    assert _targets(gm).count(aten.to.dtype) == 1  # x.double() stays; table.double() is stored
    x = torch.randn(4, 10)
    torch.testing.assert_close(gm(x), model(x))


def test_does_not_fire_on_parameters_that_need_gradients() -> None:
    gm = export_graph(Before(), (torch.randn(4, 8),), {})
    assert not constant_fold(gm, PassContext(training=True)).modified
    frozen = Before().requires_grad_(False)
    gm = export_graph(frozen, (torch.randn(4, 8),), {})
    assert constant_fold(gm, PassContext(training=True)).counts == {"constant_folded": 2}


def test_does_not_fire_on_random_ops() -> None:
    class M(Before):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + torch.rand(6) + F.dropout(self.b, 0.5, training=True)

    gm = export_graph(M(), (torch.randn(4, 6),), {})
    assert not constant_fold(gm, PassContext()).modified
    assert {aten.rand.default, aten.dropout.default} <= set(_targets(gm))


def test_does_not_fire_when_the_result_would_blow_up_memory() -> None:
    class M(Before):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + self.b.expand(64, 6) + self.b.repeat(64, 1)   # 64x the parameter

    gm = export_graph(M(), (torch.randn(64, 6),), {})
    assert not constant_fold(gm, PassContext()).modified
    # Over the byte limit: w * 2 is 192 bytes.
    gm = export_graph(Before(), (torch.randn(4, 8),), {})
    result = constant_fold(gm, PassContext(options={"max_bytes": 100}))
    assert result.counts == {"constant_folded": 1}  # only exp(b), 24 bytes
    assert aten.mul.Tensor in _targets(gm)


def test_does_not_fire_on_mutated_buffers_or_returned_constants() -> None:
    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("count", torch.zeros(3))
            self.w = nn.Parameter(torch.randn(3))

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            self.count += 1                     # changes every call: not a constant
            return x + self.count * 2, self.w * 2  # a returned constant must stay fresh

    model = M()
    gm = export_graph(model, (torch.randn(3),), {})
    assert not constant_fold(gm, PassContext()).modified
