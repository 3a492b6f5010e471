"""Fuzz ``autoopt.optimize`` with random small models: never a wrong answer, never a crash,
never a modified user model.

Each example builds a model from a random spec (``graphs.py``), optimizes it for inference with
a random subset of passes disabled and a random capture order, then compares the result with an
eager copy on fresh inputs. A pass that would change the function must have been rolled back (or
the capture fallen back); either way the answer must be eager's.

    pytest tests/fuzz                                # ci profile: ~200 examples, deterministic
    pytest tests/fuzz --hypothesis-profile long      # 2000 examples, random
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from checks import assert_bit_identical, snapshot
from fuzz.graphs import CAPTURES, FuzzCase, ModelSpec, build, fuzz_cases, model_specs
from hypothesis import event, given, settings
from torch import nn

import autoopt
from autoopt.check.compare import compare
from autoopt.check.inputs import input_sets

# A different seed from the one verification draws its inputs with.
_FRESH_SEED = 4242


def _modes(model: nn.Module) -> list[bool]:
    return [m.training for m in model.modules()]


def _run(model: nn.Module, x: torch.Tensor) -> Any:
    torch.manual_seed(0)  # train-mode dropout draws the same mask in both
    return model(x)


def _check_case(case: FuzzCase) -> autoopt.OptimizedModule:
    """Optimize ``case`` and assert the result is eager's function on fresh inputs."""
    model, x = build(case.spec)
    before, modes = snapshot(model), _modes(model)
    reference = copy.deepcopy(model)
    fast = autoopt.optimize(model, (x,), training=False, disable=list(case.disable),
                            capture=case.capture, **case.options)
    assert_bit_identical(model, before)
    assert _modes(model) == modes, "optimize changed the user's train/eval flags"
    report = fast.report
    with torch.no_grad():
        for i, (args, _) in enumerate(input_sets((x,), {}, 2, seed=_FRESH_SEED)):
            result = compare(_run(reference, args[0]), _run(fast, args[0]))
            assert result.ok, f"input set {i}: {result.detail}\n{report}"
    assert_bit_identical(model, before)
    method = report.capture_method
    event(f"capture: {method}")
    for name in report.rolled_back:
        event(f"rolled back: {name}")
    if method == "eager":
        event("fell back to eager")
        assert report.warnings, "an eager fallback must say why"
    for name, count in report.pass_counts.items():
        event(f"rewrote: {name}")
        assert count > 0
    return fast


@given(fuzz_cases())
def test_optimize_matches_eager_or_falls_back(case: FuzzCase) -> None:
    _check_case(case)


def _graph_codes(fast: autoopt.OptimizedModule) -> list[str]:
    return [spec.graph.code for spec in fast.specializations if spec.method == "export"]


@settings(max_examples=max(1, settings.default.max_examples // 9))
@given(model_specs(max_steps=4))
def test_optimize_is_deterministic(spec: ModelSpec) -> None:
    """The same model and inputs give the same graph and the same pass counts twice."""
    model, x = build(spec)
    first = autoopt.optimize(model, (x,), training=False, capture=CAPTURES[0])
    second = autoopt.optimize(model, (x,), training=False, capture=CAPTURES[0])
    assert first.report.capture_method == second.report.capture_method
    assert _graph_codes(first) == _graph_codes(second)
    assert first.report.pass_counts == second.report.pass_counts
    assert ([(r.name, r.status) for r in first.report.captures[0].passes]
            == [(r.name, r.status) for r in second.report.captures[0].passes])
