"""Checks shared by the tests."""

from __future__ import annotations

import copy
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from autoopt.check.compare import compare
from autoopt.check.inputs import input_sets
from autoopt.cost_model import CostCache, CostModel
from autoopt.cost_model.contention import Sharing, Watch


def snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer, cloned, to check bit-identity later."""
    state = {f"param:{n}": p.detach().clone() for n, p in model.named_parameters()}
    state.update({f"buffer:{n}": b.detach().clone() for n, b in model.named_buffers()})
    return state


def assert_bit_identical(model: nn.Module, before: dict[str, torch.Tensor]) -> None:
    after = snapshot(model)
    assert after.keys() == before.keys()
    for name, value in before.items():
        assert torch.equal(after[name], value), f"{name} was modified"


def assert_same_function(reference: nn.Module, optimized: nn.Module, args: tuple[Any, ...],
                         kwargs: dict[str, Any], n_random: int = 2, seed: int = 123) -> None:
    """Eager ``reference`` and ``optimized`` agree on the inputs and on fresh random ones
    (drawn with a different seed from the one verification used)."""
    reference = copy.deepcopy(reference)
    for a, k in input_sets(args, kwargs, n_random, seed=seed):
        with torch.no_grad():
            expected = reference(*a, **k)
            actual = optimized(*a, **k)
        result = compare(expected, actual)
        assert result.ok, result.detail


def simulated_watch(others: float) -> type[Watch]:
    """A ``Watch`` that reports, instead of reading the machine, ``others`` of 2 cores kept
    busy by other processes while this one ran 2 threads: 0.0 a quiet machine, 1.0 a shared
    one. Patched over ``autoopt.cost_model.model.Watch``."""

    class Simulated(Watch):
        def __exit__(self, *exc: object) -> None:
            self.sharing = Sharing(cores=2, others=others, threads=2)

    return Simulated


def spin(seconds: float, calls: list[str], name: str) -> Any:
    """A candidate of known speed: ``seconds`` of busy wall-clock time a run, each run named
    in ``calls``."""
    def run() -> None:
        calls.append(name)
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            pass
    return run


def cost_model(folder: Path) -> CostModel:
    """A cost model measuring into its own cache in ``folder``, with no cache eviction before
    each run (the spin candidates read no memory)."""
    cost = CostModel(cache=CostCache(folder / "costs.json"))
    cost.evict_cache = lambda *a, **k: None  # type: ignore[method-assign]
    return cost
