"""Measuring runs leave no trace: every entry point of the cost model and the memory planner that
runs a graph or a module on real values puts back what the run changed (``preserved``).

Each entry point runs on each model below; afterwards the model's and the graph's parameters
and buffers, the inputs and the global RNG must be bit-identical to before:

    BatchNorm   conv ─ bn(train: running stats, num_batches_tracked) ─ relu ─ dropout ─ linear
    Counter     calls += 1 (an in-place buffer), linear(x) * calls
    Writer      x *= 2 (the forward writes its input), linear
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.fx import GraphModule

from autoopt.capture.graph import export_graph
from autoopt.check.state import preserved
from autoopt.cost_model import CostCache, CostModel
from autoopt.passes import PassContext
from autoopt.planning.activations import profile_activations
from autoopt.runtime.budget import plan_for


class BatchNormNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv, self.bn = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.drop, self.head = nn.Dropout(0.5), nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.drop(torch.relu(self.bn(self.conv(x))))  # (B, 8, H, W)
        return self.head(h.mean((2, 3)))


class Counter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.add_(1)
        return self.fc(x) * self.calls


class Writer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x.mul_(2)
        return self.fc(x)


MODELS: dict[str, Callable[[], tuple[nn.Module, torch.Tensor]]] = {
    "batchnorm": lambda: (BatchNormNet().train(), torch.randn(2, 3, 8, 8)),
    "counter": lambda: (Counter().train(), torch.randn(4, 8)),
    "writer": lambda: (Writer().train(), torch.randn(4, 8)),
}


def _cost(tmp_path: Path) -> CostModel:
    return CostModel("cpu", cache=CostCache(tmp_path / "costs.json"), repeats=3)


# Each entry point: (cost model, model, its graph, input) -> None.
ENTRY_POINTS: dict[str, Callable[[CostModel, nn.Module, GraphModule, torch.Tensor], Any]] = {
    "profile": lambda cost, model, gm, x: cost.profile(gm, [x]),
    "profile_training_in_model": lambda cost, model, gm, x: cost.profile(
        gm, [x], training=True, in_model=True),
    "profile_random_inputs": lambda cost, model, gm, x: cost.profile(gm),
    "measure": lambda cost, model, gm, x: cost.measure(model, (x,), repeats=3),
    "fastest": lambda cost, model, gm, x: cost.fastest(
        f"isolation|{type(model).__name__}", {"eager": lambda: model(x), "graph": lambda: gm(x)},
        state=(model, gm, x)),
    "profile_activations": lambda cost, model, gm, x: profile_activations(gm, [x], cost),
    "plan_for": lambda cost, model, gm, x: plan_for(
        gm, PassContext((x,), torch.device("cpu"), True, cost), 1 << 30),
}


def _state(*modules: nn.Module) -> list[tuple[str, torch.Tensor, int]]:
    """Every parameter and buffer: name, a copy, and its version counter."""
    return [(f"{i}.{name}", t.detach().clone(), t._version) for i, m in enumerate(modules)
            for name, t in (*m.named_parameters(), *m.named_buffers())]


def _assert_bit_identical(before: list[tuple[str, torch.Tensor, int]],
                          after: list[tuple[str, torch.Tensor, int]]) -> None:
    assert [name for name, _, _ in after] == [name for name, _, _ in before]
    for (name, old, _), (_, new, _) in zip(before, after, strict=True):
        assert torch.equal(old.view(-1).view(torch.uint8), new.view(-1).view(torch.uint8)), name


@pytest.mark.parametrize("entry", ENTRY_POINTS)
@pytest.mark.parametrize("name", MODELS)
def test_measuring_runs_leave_model_graph_inputs_and_rng_as_they_were(
        name: str, entry: str, tmp_path: Path) -> None:
    model, x = MODELS[name]()
    gm = export_graph(model, (x.clone(),), {})
    cost = _cost(tmp_path)
    cost.info  # noqa: B018 - the device's ceilings, measured once before the snapshot
    before, x_before, x_version = _state(model, gm), x.clone(), x._version
    rng = torch.get_rng_state()
    ENTRY_POINTS[entry](cost, model, gm, x)
    _assert_bit_identical(before, _state(model, gm))
    assert torch.equal(x, x_before)
    if entry != "fastest":  # its candidates close over x: written, then put back in place
        assert x._version == x_version  # never written: the runs had copies
    assert torch.equal(torch.get_rng_state(), rng)


def test_device_ceilings_do_not_draw_from_the_global_rng(tmp_path: Path) -> None:
    rng = torch.get_rng_state()
    assert _cost(tmp_path).info.ceilings is not None  # measured here: a fresh cache
    assert torch.equal(torch.get_rng_state(), rng)


def test_preserved_puts_back_written_inputs_and_leaves_untouched_ones_unwritten() -> None:
    written, untouched = torch.randn(4), torch.randn(4)
    saved = written.clone()
    version = untouched._version
    with preserved((written, [untouched])):
        written.mul_(2)
        torch.rand(3)
    assert torch.equal(written, saved)
    assert untouched._version == version  # not written back: autograd graphs holding it agree


def test_preserved_still_takes_modules_alone() -> None:
    model = BatchNormNet().train()
    stats = model.bn.running_mean.clone()
    with preserved(model):
        model(torch.randn(2, 3, 8, 8))
    assert torch.equal(model.bn.running_mean, stats) and model.bn.num_batches_tracked == 0
