"""Static int8's fallback (``static_int8.Fallback``): the ops int8 errs at most kept in
floating point, as few as bring an engine within the tolerance, and no more builds once
keeping ops stops lowering the error (each build is a quantize and compile: 13-18 s on
BERT-base). The engine here is a stand-in whose error is set by how many ops it keeps; the
error itself is measured as for a real engine, against eager on unseen inputs."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from autoopt.backends import static_int8
from autoopt.options.calibration import calibration


def _mlp(layers: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(layers)]
                         ).eval()


def _fallback(model: nn.Module, tolerance: float = 0.05, wide: float = 1.0
              ) -> static_int8.Fallback:
    """The fallback of ``model``'s graph, calibrated on inputs whose first feature is
    ``wide`` times the others'."""
    scale = torch.ones(8)
    scale[0] = wide
    x = torch.randn(2, 8) * scale
    source = torch.export.export(model, (x,)).module()
    batches = [(torch.randn(2, 8) * scale,) for _ in range(6)]
    return static_int8.Fallback(source, model, calibration(batches), (x,), {}, tolerance)


def _engine(model: nn.Module, error_of: Callable[[int], float], built: list[int]
            ) -> Callable[[list[str]], Callable[..., torch.Tensor]]:
    """An engine built with ``kept`` ops in floating point that errs by ``error_of(len(kept))``
    (an output offset by that much; the outputs lie within ±1)."""
    def attempt(kept: list[str]) -> Callable[..., torch.Tensor]:
        built.append(len(kept))
        return lambda x: model(x) + error_of(len(kept))
    return attempt


def test_keeping_ops_goes_on_while_it_lowers_the_error_and_stops_within_the_tolerance(
        ) -> None:
    model = _mlp(20)
    built: list[int] = []
    errors = {0: 0.5, 1: 0.2, 3: 0.01}  # 5% and 15% of 20 ops kept
    run = _fallback(model).within(_engine(model, errors.__getitem__, built))
    assert built == [0, 1, 3]
    x = torch.randn(2, 8)
    assert torch.allclose(run(x), model(x) + 0.01)


def test_no_more_builds_once_keeping_ops_leaves_the_error_where_it_was() -> None:
    model = _mlp(20)
    built: list[int] = []
    # int8 errs across the graph: the worst ops kept change nothing worth another build.
    errors = {0: 0.10, 1: 0.095, 3: 0.03, 7: 0.01}
    run = _fallback(model).within(_engine(model, errors.__getitem__, built))
    assert built == [0, 1]
    x = torch.randn(2, 8)
    assert torch.allclose(run(x), model(x) + 0.095)  # the one that erred least


def test_the_same_number_of_ops_is_not_built_twice() -> None:
    model = _mlp(3)  # 5% and 15% of 3 ops round to the same one op; 35% to 1 too
    built: list[int] = []
    errors = {0: 0.5, 1: 0.2}
    run = _fallback(model).within(_engine(model, errors.__getitem__, built))
    assert built == [0, 1]
    x = torch.randn(2, 8)
    assert torch.allclose(run(x), model(x) + 0.2)


def test_the_ranking_puts_first_the_op_that_errs_most_alone() -> None:
    model = _mlp(4)
    # The first linear reads a feature 300 times the others: one int8 step per tensor is as
    # wide as most of its input. The later ones read tanh's outputs, within ±1.
    ranked = _fallback(model, wide=300.0).ranked()
    assert len(ranked) == 4
    assert ranked[0] == "linear"  # export's name for the first linear
