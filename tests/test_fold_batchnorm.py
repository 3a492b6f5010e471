"""fold_batchnorm: eval BatchNorm moves into the conv/linear before it, at ATen and module level."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn
from torch.fx import GraphModule

import autoopt
from autoopt.capture.graph import export_graph, symbolic_trace_graph
from autoopt.passes import PassContext, fold_batchnorm

aten = torch.ops.aten
BATCH_NORMS = {aten.batch_norm.default, aten._native_batch_norm_legit_no_training.default}


class Before(nn.Module):
    """x ─ conv ─ bn ─ relu ─ y"""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.bn(self.conv(x)))


class Expected(nn.Module):
    """What fold_batchnorm should leave of Before: x ─ conv' ─ relu ─ y."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.conv(x))


# (model, input shape): every producer kind the pass folds into.
CASES: dict[str, tuple[Callable[[], nn.Module], tuple[int, ...]]] = {
    "conv1d": (lambda: nn.Sequential(nn.Conv1d(3, 8, 3), nn.BatchNorm1d(8)), (2, 3, 10)),
    "conv2d": (lambda: nn.Sequential(nn.Conv2d(3, 8, 3, stride=2), nn.BatchNorm2d(8)),
               (2, 3, 9, 9)),
    "conv3d": (lambda: nn.Sequential(nn.Conv3d(3, 8, 3), nn.BatchNorm3d(8)), (2, 3, 5, 5, 5)),
    "conv2d_no_bias": (lambda: nn.Sequential(nn.Conv2d(3, 8, 3, bias=False), nn.BatchNorm2d(8)),
                       (2, 3, 7, 7)),
    "grouped_conv2d": (lambda: nn.Sequential(nn.Conv2d(4, 8, 3, groups=2), nn.BatchNorm2d(8)),
                       (2, 4, 7, 7)),
    "conv_transpose2d": (lambda: nn.Sequential(nn.ConvTranspose2d(3, 8, 3, stride=2),
                                               nn.BatchNorm2d(8)), (2, 3, 5, 5)),
    "linear_bn1d": (lambda: nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8)), (4, 6)),
    "bn_without_affine": (lambda: nn.Sequential(nn.Conv2d(3, 8, 1),
                                                nn.BatchNorm2d(8, affine=False)), (2, 3, 4, 4)),
}


def _model(factory: Callable[[], nn.Module]) -> nn.Module:
    """An eval model whose BatchNorms have non-trivial statistics (the defaults, mean 0 and
    var 1, would let a wrong fold pass)."""
    model = factory().eval()
    with torch.no_grad():
        for bn in model.modules():
            if isinstance(bn, nn.modules.batchnorm._BatchNorm):
                bn.running_mean.uniform_(-1, 1)
                bn.running_var.uniform_(0.5, 2)
                if bn.affine:
                    bn.weight.uniform_(0.5, 1.5)
                    bn.bias.uniform_(-1, 1)
    return model


def _targets(gm: GraphModule) -> list[object]:
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def _module_kinds(gm: GraphModule) -> list[type]:
    return [type(gm.get_submodule(n.target)) for n in gm.graph.nodes if n.op == "call_module"]


def test_before_becomes_expected_at_aten_level() -> None:
    x = torch.randn(2, 3, 8, 8)
    result = fold_batchnorm(export_graph(_model(Before), (x,), {}), PassContext())
    expected = export_graph(Expected().eval(), (x,), {})
    assert result.modified and result.counts == {"folded_bn": 1}
    assert _targets(result.graph_module) == _targets(expected)
    attrs = [n for n in result.graph_module.graph.nodes if n.op == "get_attr"]
    assert all(isinstance(n.meta["val"], torch.Tensor) for n in attrs)


def test_before_becomes_expected_at_module_level() -> None:
    x = torch.randn(2, 3, 8, 8)
    gm, _ = symbolic_trace_graph(_model(Before), (x,), {})
    assert fold_batchnorm(gm, PassContext()).counts == {"folded_bn": 1}
    assert _module_kinds(gm) == [nn.Conv2d]


@pytest.mark.parametrize("case", sorted(CASES))
def test_matches_eager_at_aten_level(case: str) -> None:
    factory, shape = CASES[case]
    model = _model(factory)
    gm = export_graph(model, (torch.randn(shape),), {})
    result = fold_batchnorm(gm, PassContext())
    assert result.counts == {"folded_bn": 1}
    assert not BATCH_NORMS & set(_targets(gm))
    gm.graph.lint()
    for _ in range(3):
        x = torch.randn(shape)
        torch.testing.assert_close(gm(x), model(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("case", sorted(CASES))
def test_matches_eager_at_module_level(case: str) -> None:
    factory, shape = CASES[case]
    model = _model(factory)
    gm, positional = symbolic_trace_graph(model, (torch.randn(shape),), {})
    assert fold_batchnorm(gm, PassContext()).counts == {"folded_bn": 1}
    assert not any(issubclass(k, nn.modules.batchnorm._BatchNorm) for k in _module_kinds(gm))
    for _ in range(3):
        x = torch.randn(shape)
        torch.testing.assert_close(gm(*positional(x)), model(x), rtol=1e-5, atol=1e-5)


def test_folds_the_decomposed_tuple_variant() -> None:
    """After decomposition: aten.convolution and _native_batch_norm_legit_no_training + getitem."""
    model = _model(Before)
    x = torch.randn(2, 3, 8, 8)
    gm = torch.export.export(model, (x,)).run_decompositions().module()
    assert aten._native_batch_norm_legit_no_training.default in _targets(gm)
    assert fold_batchnorm(gm, PassContext()).counts == {"folded_bn": 1}
    assert _targets(gm) == [aten.convolution.default, aten.relu.default]
    x = torch.randn(2, 3, 8, 8)
    torch.testing.assert_close(gm(x), model(x), rtol=1e-5, atol=1e-5)


def test_leaves_the_original_parameters_bit_identical() -> None:
    model = _model(CASES["conv2d_no_bias"][0])
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.randn(2, 3, 7, 7)
    fold_batchnorm(export_graph(model, (x,), {}), PassContext())
    gm, _ = symbolic_trace_graph(model, (x,), {})
    fold_batchnorm(gm, PassContext())
    after = model.state_dict()
    assert after.keys() == before.keys()
    assert all(torch.equal(after[k], v) for k, v in before.items())
    assert model[0].bias is None


def test_does_not_fire_on_batchnorm_in_train_mode() -> None:
    model = _model(Before).train()
    x = torch.randn(2, 3, 8, 8)
    assert not fold_batchnorm(export_graph(model, (x,), {}), PassContext()).modified
    gm, _ = symbolic_trace_graph(model, (x,), {})
    assert not fold_batchnorm(gm, PassContext()).modified


def test_does_not_fire_when_the_conv_output_has_another_user() -> None:
    class TwoUsers(Before):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.conv(x)
            return self.bn(y) + y.sigmoid()  # y itself is needed, un-normalized

    model = _model(TwoUsers)
    x = torch.randn(2, 3, 8, 8)
    assert not fold_batchnorm(export_graph(model, (x,), {}), PassContext()).modified
    gm, _ = symbolic_trace_graph(model, (x,), {})
    assert not fold_batchnorm(gm, PassContext()).modified


def test_does_not_fire_when_the_conv_weight_is_shared() -> None:
    class Tied(Before):
        def __init__(self) -> None:
            super().__init__()
            self.other = nn.Conv2d(3, 8, 3, padding=1)
            self.other.weight = self.conv.weight

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.bn(self.conv(x)) + self.other(x)

    model = _model(Tied)
    x = torch.randn(2, 3, 8, 8)
    assert not fold_batchnorm(export_graph(model, (x,), {}), PassContext()).modified
    gm, _ = symbolic_trace_graph(model, (x,), {})
    assert not fold_batchnorm(gm, PassContext()).modified


def test_does_not_fire_on_grouped_transposed_conv() -> None:
    model = _model(lambda: nn.Sequential(nn.ConvTranspose2d(4, 8, 3, groups=2),
                                         nn.BatchNorm2d(8)))
    gm = export_graph(model, (torch.randn(2, 4, 5, 5),), {})
    assert not fold_batchnorm(gm, PassContext()).modified


def test_does_not_fire_when_gradients_are_needed() -> None:
    """Folding would replace the conv and BatchNorm weights by constants without gradients."""
    gm = export_graph(_model(Before), (torch.randn(2, 3, 8, 8),), {})
    assert not fold_batchnorm(gm, PassContext(training=True)).modified
    frozen = _model(Before).requires_grad_(False)
    gm = export_graph(frozen, (torch.randn(2, 3, 8, 8),), {})
    assert fold_batchnorm(gm, PassContext(training=True)).counts == {"folded_bn": 1}


@pytest.mark.slow
def test_resnet18_end_to_end() -> None:
    torchvision = pytest.importorskip("torchvision")
    # Frozen weights: with requires_grad parameters `optimize` keeps gradients exact and folds
    # nothing (see test_does_not_fire_when_gradients_are_needed).
    model = torchvision.models.resnet18(num_classes=10).eval().requires_grad_(False)
    fast = autoopt.optimize(model, (torch.randn(2, 3, 64, 64),))
    assert fast.report.pass_counts["folded_bn"] == 20
    x = torch.randn(2, 3, 64, 64)
    torch.testing.assert_close(fast(x), model(x), rtol=1e-4, atol=1e-4)
