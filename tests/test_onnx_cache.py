"""The ONNX graph cache: a second lowering of the same graph opens ONNX Runtime on the graph
exported before, with this run's weights, and is verified like any lowering.

Each test optimizes with ``backend="onnxruntime"`` into the suite's private cache folder and
counts the exports by wrapping the exporter.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import autoopt
from autoopt.backends import onnxruntime as ort
from autoopt.onnx import cache as onnx_cache
from autoopt.onnx import graph as onnx_graph

onnx = pytest.importorskip("onnx")
pytestmark = [pytest.mark.filterwarnings("ignore"),
              pytest.mark.skipif(bool(ort.available()), reason=ort.available() or "")]


class Net(nn.Module):
    """Conv, BatchNorm (folded by autoopt before export), ReLU, pooling: every initializer
    the exporter writes is one of the graph's tensors."""

    def __init__(self, channels: int = 6) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, channels, 3, padding=1)
        self.bn = nn.BatchNorm2d(channels)
        self.pool = nn.AdaptiveAvgPool2d(2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.pool(torch.relu(self.bn(self.conv(x))))


def net(seed: int, channels: int = 6) -> nn.Module:
    torch.manual_seed(seed)
    model = Net(channels).eval()
    with torch.no_grad():  # statistics that are not the identity, so folding shows
        model.bn.running_mean.uniform_(-1, 1)
        model.bn.running_var.uniform_(0.5, 2)
    return model


@pytest.fixture
def exports(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> list[Path]:
    """The paths the ONNX Runtime backend exported to, in order; a cache of this test's own."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    seen: list[Path] = []
    write = onnx_graph.write_onnx

    def counted(gm: Any, args: Any, kwargs: Any, path: Path, *rest: Any) -> Any:
        seen.append(path)
        return write(gm, args, kwargs, path, *rest)

    monkeypatch.setattr(onnx_graph, "write_onnx", counted)
    return seen


def optimized(model: nn.Module, x: torch.Tensor) -> autoopt.OptimizedModule:
    fast = autoopt.optimize(model, (x,), backend="onnxruntime")
    assert fast.specializations[0].backend == "onnxruntime"
    return fast


@torch.no_grad()
def test_the_same_graph_with_other_weights_is_not_exported_again(exports: list[Path]) -> None:
    x = torch.randn(2, 3, 8, 8)
    first = net(0)
    torch.testing.assert_close(optimized(first, x)(x), first(x))
    assert len(exports) == 1
    entries = list(onnx_cache.folder().glob("*.onnx"))
    assert len(entries) == 1
    weights = [i for i in onnx.load(str(entries[0]), load_external_data=False).graph.initializer
               if i.data_type == onnx.TensorProto.FLOAT]
    assert weights and all(i.data_location == onnx.TensorProto.EXTERNAL and not i.raw_data
                           for i in weights)  # no weight kept on disk
    second = net(1)  # the same graph, other weights: the cached graph takes these
    fast = optimized(second, x)
    assert len(exports) == 1
    torch.testing.assert_close(fast(x), second(x))
    y = torch.randn(2, 3, 8, 8)
    torch.testing.assert_close(fast(y), second(y))


@torch.no_grad()
def test_other_shapes_are_exported_anew(exports: list[Path]) -> None:
    x = torch.randn(1, 3, 8, 8)
    optimized(net(0, channels=5), x)
    model = net(1, channels=7)  # other weight shapes: another key
    torch.testing.assert_close(optimized(model, x)(x), model(x))
    assert len(exports) == 2


@torch.no_grad()
def test_a_damaged_entry_is_exported_again(exports: list[Path]) -> None:
    x = torch.randn(1, 3, 8, 8)
    optimized(net(0, channels=4), x)
    for entry in onnx_cache.folder().glob("*.onnx"):
        entry.write_bytes(b"not an onnx graph")
    model = net(1, channels=4)
    torch.testing.assert_close(optimized(model, x)(x), model(x))
    assert len(exports) == 2


@torch.no_grad()
def test_transposed_linear_weights_are_cached(exports: list[Path]) -> None:
    """A linear on a batch of sequences is written as a MatMul with the weight transposed:
    the entry gives ONNX Runtime the module's weight transposed."""
    x = torch.randn(2, 3, 16)
    for seed in range(2):
        torch.manual_seed(seed)
        model = nn.Sequential(nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 4)).eval()
        fast = autoopt.optimize(model, (x,), backend="onnxruntime")
        torch.testing.assert_close(fast(x), model(x))
    assert len(exports) == 1


class Reversed(nn.Module):
    """A linear whose features are read back to front: the exporter writes the index list as
    an integer constant of its own, large enough to go to the weights file."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 128)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)[:, :, list(range(127, -1, -1))]


@torch.no_grad()
def test_the_exporter_s_own_constants_are_kept_in_the_entry(exports: list[Path]) -> None:
    """The entry kept such a constant pointing into the exporter's weights file, which is not
    kept; the next optimize wrote this run's weights under that name and ONNX Runtime read
    weights as the index (4.0 off: verification rejected the cached graph). The constant is
    now written into the entry's graph."""
    x = torch.randn(3, 5, 4)
    for seed in range(2):
        torch.manual_seed(seed)
        model = Reversed().eval()
        fast = optimized(model, x)
        torch.testing.assert_close(fast(x), model(x))
    assert len(exports) == 1


class Permuted(nn.Module):
    """A linear whose features are read through an index buffer (a channel permutation)."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        self.linear = nn.Linear(16, 16)
        generator = torch.Generator().manual_seed(seed)
        self.register_buffer("order", torch.randperm(16, generator=generator))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)[:, self.order]


@torch.no_grad()
def test_index_buffers_key_the_entry_by_value(exports: list[Path]) -> None:
    """The exporter writes an index buffer into constants of its own: a second model of the
    same shapes with another permutation ran the first one's (3.07 off, verification then
    rejecting ONNX Runtime for it, or silently wrong with ``verify=False``)."""
    x = torch.randn(4, 16)
    for seed in (1, 2):
        model = Permuted(seed).eval()
        fast = autoopt.optimize(model, (x,), backend="onnxruntime", verify=False)
        torch.testing.assert_close(fast(x), model(x))
    assert len(exports) == 2


@torch.no_grad()
def test_weights_the_exporter_computes_are_not_cached(exports: list[Path]) -> None:
    """With autoopt's BatchNorm folding off, the exporter folds the BatchNorm into the
    convolution: its weight initializer holds values no tensor of the graph holds, so
    nothing is cached and the next optimize exports again (with its own weights)."""
    x = torch.randn(1, 3, 8, 8)
    for seed in range(2):
        model = net(seed, channels=3)
        fast = autoopt.optimize(model, (x,), backend="onnxruntime",
                                disable=["fold_batchnorm"])
        torch.testing.assert_close(fast(x), model(x))
    assert len(exports) == 2


@torch.no_grad()
def test_a_graph_exported_with_zero_weights_serves_only_zero_weights(
        exports: list[Path]) -> None:
    """A freshly initialized BatchNorm folds into a bias of zeros, which the exporter drops
    from its Conv. The cached graph had no bias at all, and a later model of the same shapes
    with a bias got it: off by the bias, silently with ``verify=False`` (with verification
    ONNX Runtime was rolled back for it). The key now says which weights are zeros."""
    x = torch.randn(1, 3, 8, 8)
    fresh = Net(channels=4).eval()  # conv bias off, BatchNorm as initialized: folded bias 0
    fresh.conv.bias = None
    trained = Net(channels=4).eval()
    trained.conv.bias = None
    with torch.no_grad():
        trained.bn.bias.uniform_(0.5, 1.0)
        trained.bn.running_mean.uniform_(-1, 1)
    for model in (fresh, trained, Net(channels=4).eval().requires_grad_(False)):
        if model is not fresh and model is not trained:
            model.conv.bias = None  # zeros again: the first entry serves it
        fast = autoopt.optimize(model, (x,), backend="onnxruntime", verify=False)
        assert fast.specializations[0].backend == "onnxruntime"
        torch.testing.assert_close(fast(x), model(x))
    assert len(exports) == 2
    assert len(list(onnx_cache.folder().glob("*.onnx"))) == 2


@torch.no_grad()
def test_the_entry_compares_every_block_of_every_weight(
        exports: list[Path], monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The exported weights are read back a block of rows at a time (a few bytes here):
    a weight that differs only in its last rows, or only in a transposed one, is no entry."""
    monkeypatch.setattr(onnx_cache, "_BLOCK", 64)
    x = torch.randn(2, 3, 16)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 24), nn.GELU(), nn.Linear(24, 4)).eval()
    gm = optimized(model, x).specializations[0].graph  # the graph ONNX Runtime runs
    path = tmp_path / "graph.onnx"
    onnx_graph.write_onnx(gm, (x,), {}, path, ["x"], ["y"], None, (), None, True, "auto")
    assert onnx_cache.store("check", path, gm) == ""  # the file is the module's weights
    for name, tensor in onnx_cache.tensors_of(gm).items():
        if tensor.dim() == 2:
            kept = tensor[-1, -1].item()
            tensor[-1, -1] = kept + 1  # the last block of the weight, or its last column
            why = onnx_cache.store("check", path, gm)
            tensor[-1, -1] = kept
            assert "is not the module's tensor" in why and name in why
