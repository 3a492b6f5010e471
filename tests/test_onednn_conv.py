"""onednn_conv: 2-D convolutions (+ activation / residual add) onto oneDNN with packed weights."""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.fx import GraphModule

import autoopt
from autoopt.capture.graph import export_graph
from autoopt.cost_model import CostCache, CostModel
from autoopt.passes import PassContext, onednn_conv
from autoopt.passes.graph import portable, release_packed, restore_packed
from autoopt.passes.onednn_conv import PackedConv, available

pytestmark = pytest.mark.skipif(not available(torch.device("cpu")),
                                reason="this PyTorch build has no oneDNN fused convolution")
aten = torch.ops.aten


class Before(nn.Module):
    """x ─ conv ─ relu ─ conv ─ (+ x) ─ relu ─ y: a residual block's shape."""

    def __init__(self, act: Callable[[torch.Tensor], torch.Tensor] = torch.relu) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(8, 8, 3, padding=1)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1, bias=False)
        self.act = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.act(self.conv1(x))
        y = self.conv2(y)
        y += x
        return torch.relu(y)


def _onednn_calls(gm: GraphModule) -> list[PackedConv]:
    return [n.target for n in gm.graph.nodes if isinstance(n.target, PackedConv)]


def _targets(gm: GraphModule) -> list[object]:
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def _rewrite(model: nn.Module, shape: tuple[int, ...], **ctx_args: object
             ) -> tuple[GraphModule, dict[str, int]]:
    with torch.no_grad():
        gm = export_graph(model.eval(), (torch.randn(shape),), {})
    result = onednn_conv(gm, PassContext(**ctx_args))  # no cost model: every eligible conv
    return result.graph_module, dict(result.counts)


def _assert_same_function(gm: GraphModule, model: nn.Module, shape: tuple[int, ...],
                          draws: int = 1) -> None:
    """The rewritten graph gives the model's outputs on ``draws`` fresh inputs."""
    for _ in range(draws):
        x = torch.randn(shape)
        with torch.no_grad():
            torch.testing.assert_close(gm(x), model(x), rtol=1e-5, atol=1e-5)


def test_before_becomes_two_fused_calls() -> None:
    gm, counts = _rewrite(Before(), (2, 8, 10, 10))
    assert counts == {"conv": 2, "fused_unary": 2, "fused_add": 1}
    assert _targets(gm) == _onednn_calls(gm)  # no conv, add or relu left
    first, second = _onednn_calls(gm)
    assert (first.epilogue[0], first.add) == ("relu", False)
    assert (second.epilogue[0], second.add) == ("relu", True)


def test_packed_weights_are_dropped_and_packed_again_to_the_same_results() -> None:
    """The packed copies go while another backend is built; a call or ``restore_packed``
    packs them again for the input shape they were packed for."""
    model = Before().eval()
    gm, _ = _rewrite(model, (2, 8, 10, 10))
    x = torch.randn(2, 8, 10, 10)
    with torch.no_grad():
        expected = gm(x)
        convs = _onednn_calls(gm)
        assert release_packed(gm) == sum(c.weight.numel() * 4 for c in convs) > 0
        assert all(c.packed is None for c in convs) and release_packed(gm) == 0
        assert torch.equal(gm(x), expected)  # packed again as called
        release_packed(gm)
        restore_packed(gm)
        assert all(c.packed is not None and c.shape == [2, 8, 10, 10] for c in convs)
        assert torch.equal(gm(x), expected)


# name -> (activation after the first conv, module kwargs of the convolutions)
ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "relu": torch.relu, "relu6": F.relu6, "hardswish": F.hardswish,
    "hardsigmoid": F.hardsigmoid, "silu": F.silu, "sigmoid": torch.sigmoid, "tanh": torch.tanh,
    "gelu": F.gelu, "gelu_tanh": lambda t: F.gelu(t, approximate="tanh"),
    "leaky_relu": lambda t: F.leaky_relu(t, 0.2), "relu6_module": nn.ReLU6(),
    "softplus_unfused": F.softplus,
}


@pytest.mark.parametrize("name", sorted(ACTIVATIONS))
def test_matches_eager_for_each_activation(name: str) -> None:
    model = Before(ACTIVATIONS[name]).eval()
    gm, counts = _rewrite(model, (2, 8, 10, 10))
    assert counts["conv"] == 2
    assert counts["fused_unary"] == (1 if name.endswith("unfused") else 2)
    _assert_same_function(gm, model, (2, 8, 10, 10), draws=3)


# Convolution shapes: stride, dilation, groups (depthwise), no bias, a 1x1 projection.
GEOMETRIES = {
    "stride2": nn.Conv2d(4, 8, 3, stride=2, padding=1),
    "dilation2": nn.Conv2d(4, 8, 3, dilation=2, padding=2),
    "depthwise": nn.Conv2d(8, 8, 3, groups=8, padding=1, bias=False),
    "grouped": nn.Conv2d(8, 8, 3, groups=2),
    "pointwise": nn.Conv2d(8, 16, 1),
    "rectangular": nn.Conv2d(8, 4, (1, 7), padding=(0, 3)),
}


@pytest.mark.parametrize("name", sorted(GEOMETRIES))
def test_matches_eager_for_each_geometry(name: str) -> None:
    conv = GEOMETRIES[name]
    model = nn.Sequential(conv, nn.ReLU()).eval()
    shape = (3, conv.in_channels, 11, 13)
    gm, counts = _rewrite(model, shape)
    assert counts == {"conv": 1, "fused_unary": 1}
    _assert_same_function(gm, model, shape, draws=3)


def test_fuses_an_out_of_place_add_with_the_conv_second() -> None:
    class AddFirst(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(4, 4, 3, padding=1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return F.silu(x * 2 + self.conv(x))

    model = AddFirst().eval()
    gm, counts = _rewrite(model, (2, 4, 6, 6))
    # oneDNN fuses only ReLU after an add: the SiLU stays a separate op.
    assert counts == {"conv": 1, "fused_add": 1}
    assert aten.silu.default in _targets(gm)
    _assert_same_function(gm, model, (2, 4, 6, 6))


def test_does_not_fuse_an_add_that_writes_into_the_other_operand() -> None:
    """``x += conv(x)`` changes x itself, which a later use of x sees; the fused kernel would
    leave x as it was."""

    class WritesIntoInput(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(4, 4, 3, padding=1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = x.clone()
            y += self.conv(y)
            return y * y

    model = WritesIntoInput().eval()
    gm, counts = _rewrite(model, (2, 4, 6, 6))
    assert counts == {"conv": 1}
    assert aten.add_.Tensor in _targets(gm)
    _assert_same_function(gm, model, (2, 4, 6, 6))


def test_does_not_fuse_a_broadcasting_add_or_a_shared_output() -> None:
    class Shared(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(4, 4, 3, padding=1)
            self.scale = nn.Parameter(torch.randn(4, 1, 1))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.conv(x)
            return torch.relu(y + self.scale), torch.relu(self.conv(x)) + y

    model = Shared().eval()
    gm, counts = _rewrite(model, (2, 4, 6, 6))
    # The first conv's output has two users: no epilogue is fused into it; the second conv's
    # relu is.
    assert counts == {"conv": 2, "fused_unary": 1}
    assert aten.add.Tensor in _targets(gm)
    _assert_same_function(gm, model, (2, 4, 6, 6))


def test_does_not_fire_when_training() -> None:
    assert _rewrite(Before(), (2, 8, 10, 10), training=True)[1] == {}


@pytest.mark.parametrize("measured", [False, True])
def test_symbolic_sizes_are_measured_as_traced_and_fused_without_a_guard(
        measured: bool, tmp_path: Path) -> None:
    """A graph captured with ``dynamic=`` (any batch and image size) gets the fused kernels,
    measured at the sizes it was traced with, and stays symbolic: the pass adds no guard (a
    residual add's shapes are compared without one)."""
    model = Before().eval()
    with torch.no_grad():
        gm = export_graph(model, (torch.randn(2, 8, 10, 10),), {}, dynamic=True)
    x = next(n for n in gm.graph.nodes if n.op == "placeholder" and n.meta["val"].dim() == 4
             and not isinstance(n.meta["val"].shape[0], int))
    env = x.meta["val"].shape[0].node.shape_env
    guards = len(env.guards)
    cache = CostCache(tmp_path / "costs.json")
    result = onednn_conv(gm, PassContext(cost=CostModel("cpu", cache=cache) if measured
                                         else None))
    assert len(env.guards) == guards
    if measured:
        keys = [k for k, _ in cache.items() if k.startswith("fastest|conv2d")]
        assert len(keys) == 2 and all("|(2, 8, 10, 10)|" in k and "|dynamic|" in k
                                      for k in keys)
    else:
        assert dict(result.counts) == {"conv": 2, "fused_unary": 2, "fused_add": 1}
    for shape in [(2, 8, 10, 10), (3, 8, 7, 12), (5, 8, 10, 10)]:
        _assert_same_function(result.graph_module, model, shape)


def test_does_not_fire_for_a_cuda_target() -> None:
    assert _rewrite(Before(), (2, 8, 10, 10), device=torch.device("cuda"))[1] == {}


def test_the_cost_model_chooses_and_remembers(tmp_path: Path) -> None:
    cache = CostCache(tmp_path / "costs.json")
    cost = CostModel("cpu", cache=cache)
    gm, counts = _rewrite(Before(), (1, 8, 10, 10), cost=cost)
    choices = {k: v for k, v in cache.items() if k.startswith("fastest|conv2d")}
    assert len(choices) == 2  # two distinct convolutions, each measured both ways
    assert all(set(v) == {"onednn", "aten"} for v in choices.values())
    assert counts.get("conv", 0) + counts.get("kept_aten", 0) == 2
    # Ask again: the figures come from the cache (nothing re-measured, same decision).
    again = CostModel("cpu", cache=CostCache(tmp_path / "costs.json"))
    assert _rewrite(Before(), (1, 8, 10, 10), cost=again)[1] == counts


def test_cost_model_fastest_picks_the_faster_and_caches_it(tmp_path: Path) -> None:
    cost = CostModel("cpu", cache=CostCache(tmp_path / "costs.json"))
    calls = {"slow": 0, "fast": 0}
    big = torch.randn(512, 512)

    def slow() -> None:
        calls["slow"] += 1
        for _ in range(20):
            big @ big

    def fast() -> None:
        calls["fast"] += 1

    assert cost.fastest("demo", {"slow": slow, "fast": fast})[0] == "fast"
    before = dict(calls)
    best, seconds = cost.fastest("demo", {"slow": slow, "fast": fast})
    assert best == "fast" and seconds["slow"] > seconds["fast"]
    assert calls == before  # read from the cache


def test_optimize_uses_it_and_exports_take_the_portable_graph(tmp_path: Path) -> None:
    import torchvision

    model = torchvision.models.resnet18(num_classes=10).eval()
    x = torch.randn(1, 3, 64, 64)
    fast = autoopt.optimize(model, (x,), pass_options={"onednn_conv": {"measure": False}})
    record = next(p for p in fast.report.captures[0].passes if p.name == "onednn_conv")
    assert record.status == "applied" and record.counts["conv"] == 20
    gm = fast.specializations[0].graph
    assert not {aten.conv2d.default, aten.relu_.default} & set(_targets(gm))
    assert aten.conv2d.default in _targets(portable(gm)) and not _onednn_calls(portable(gm))
    with torch.no_grad():
        torch.testing.assert_close(fast(x), model(x), rtol=1e-4, atol=1e-4)
        # Packed weights are shared, not copied, by a deep copy.
        torch.testing.assert_close(copy.deepcopy(fast)(x), model(x), rtol=1e-4, atol=1e-4)
    report = autoopt.export_onnx(fast, (x,), tmp_path / "resnet18.onnx")
    assert report.ok


def test_each_packed_conv_has_its_own_cost_key() -> None:
    """Two convs with the same input and output shapes but different kernels must not share a
    cached measurement: the weight is bound in the call, so its shape is in the op name."""
    from autoopt.cost_model.estimate import op_family, op_name

    model = nn.Sequential(nn.Conv2d(4, 4, 3, padding=1), nn.Conv2d(4, 4, 1)).eval()
    gm, _ = _rewrite(model, (1, 4, 8, 8))
    names = {op_name(k) for k in _onednn_calls(gm)}
    assert len(names) == 2 and {op_family(n) for n in names} == {"conv"}


def test_repacks_when_the_thread_count_changes() -> None:
    """Packing is tuned to the thread count (run at another, a packed conv measured up to 6x
    slower), so a call at a new count packs the weight again, and still computes the same."""
    model = Before().eval()
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        gm, _ = _rewrite(model, (2, 8, 10, 10))
        kernels = _onednn_calls(gm)
        assert {k.threads for k in kernels} == {1}
        torch.set_num_threads(2)
        x = torch.randn(2, 8, 10, 10)
        with torch.no_grad():
            torch.testing.assert_close(gm(x), model(x), rtol=1e-5, atol=1e-5)
        assert {k.threads for k in kernels} == {2}
    finally:
        torch.set_num_threads(threads)
