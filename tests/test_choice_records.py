"""Records of measured backend choices never hide a candidate: a candidate that failed is tried
again at the next optimize, a damaged record is measured again, records carry autoopt's
version, and the ONNX cache serves each model its own constants.

Each test has a cache folder of its own (``XDG_CACHE_HOME``), so that no other test's record
of the same small model decides for it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import autoopt
from autoopt.backends import onnxruntime as ort
from autoopt.backends import openvino
from autoopt.cost_model import CostCache, CostModel
from autoopt.cost_model.cache import library_versions
from autoopt.passes import PASS_NAMES

from .checks import assert_same_function

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


@pytest.fixture(autouse=True)
def own_cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    return tmp_path / "autoopt"


def cnn() -> tuple[nn.Module, tuple[Any, ...]]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                          nn.Flatten(), nn.Linear(8, 10))
    return model.eval(), (torch.randn(2, 3, 16, 16),)


BACKENDS = ("aten", "onnxruntime")


@pytest.mark.skipif(bool(openvino.available()), reason=openvino.available() or "installed")
def test_a_candidate_that_failed_to_build_is_measured_at_the_next_optimize(
        monkeypatch: pytest.MonkeyPatch) -> None:
    real, calls = ort.lower, []

    def fails_once(*a: Any, **k: Any) -> Any:
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("a transient failure")
        return real(*a, **k)

    monkeypatch.setattr(ort, "lower", fails_once)
    model, args = cnn()
    # Three candidates: the two others measured make a record, which must not hide the third.
    backends = (*BACKENDS, "openvino")
    first = autoopt.optimize(model, args, backends=backends)
    (choice,) = first.report.backends
    assert choice.skipped["onnxruntime"] == "failed to lower: RuntimeError: a transient failure"
    assert set(choice.seconds) == {"aten", "openvino"}
    again = autoopt.optimize(model, args, backends=backends)
    (choice,) = again.report.backends
    assert not choice.cached and "onnxruntime" not in choice.skipped
    assert set(choice.seconds) == set(backends)
    assert_same_function(model, again, args, {})
    # Measured whole now: the third optimize builds the winner from the record alone.
    third = autoopt.optimize(model, args, backends=backends)
    assert third.report.backends[0].cached


def _onnxruntime_always_fails(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """ONNX Runtime's lowering fails on every build, as on a graph with an op ONNX has no
    translation for; the list returned counts the builds."""
    calls: list[int] = []

    def fails(*a: Any, **k: Any) -> Any:
        calls.append(1)
        raise RuntimeError("no translation for this op")

    monkeypatch.setattr(ort, "lower", fails)
    return calls


@pytest.mark.skipif(bool(openvino.available()), reason=openvino.available() or "installed")
def test_a_candidate_that_fails_again_is_not_tried_a_third_time(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A failure seen when the record was made and again when the choice was measured anew
    for it is the graph's (an op ONNX cannot translate), not transient: the third optimize
    builds the winner from the record, as if the candidate had been measured."""
    calls = _onnxruntime_always_fails(monkeypatch)
    model, args = cnn()
    backends = (*BACKENDS, "openvino")
    first = autoopt.optimize(model, args, backends=backends)
    assert first.report.backends[0].skipped["onnxruntime"] == \
        "failed to lower: RuntimeError: no translation for this op"
    again = autoopt.optimize(model, args, backends=backends)
    (choice,) = again.report.backends
    assert not choice.cached and len(calls) == 2
    assert choice.skipped["onnxruntime"] == \
        "failed to lower again: RuntimeError: no translation for this op"
    third = autoopt.optimize(model, args, backends=backends)
    (choice,) = third.report.backends
    assert choice.cached and len(calls) == 2
    assert choice.skipped["onnxruntime"].startswith("failed to lower again: ")
    assert_same_function(model, third, args, {})


@pytest.mark.parametrize("disable", [(), PASS_NAMES], ids=["passes", "model_as_is"])
def test_a_lone_candidate_beside_failures_is_timed_and_recorded(
        monkeypatch: pytest.MonkeyPatch, disable: tuple[str, ...]) -> None:
    """Where every other candidate fails to build, the one left is timed against eager, so
    that a record exists: the next optimize tries the failed one once more, the third builds
    only the survivor (with nothing recorded, each optimize built them all again). Where no
    pass changed the model (as on a CPU where none measures faster), aten runs the model as
    is: eager is timed alone."""
    calls = _onnxruntime_always_fails(monkeypatch)
    model, args = cnn()
    first = autoopt.optimize(model, args, backends=BACKENDS, disable=disable)
    (choice,) = first.report.backends
    assert choice.chosen == "aten" and set(choice.seconds) == {"aten"}
    assert choice.eager_s is not None and choice.eager_s > 0  # timed against eager
    again = autoopt.optimize(model, args, backends=BACKENDS, disable=disable)
    assert not again.report.backends[0].cached and len(calls) == 2
    third = autoopt.optimize(model, args, backends=BACKENDS, disable=disable)
    (choice,) = third.report.backends
    assert choice.cached and choice.chosen == "aten" and len(calls) == 2
    assert choice.skipped["onnxruntime"].startswith("failed to lower again: ")
    assert_same_function(model, third, args, {})


def test_a_record_names_the_candidates_that_failed_with_why() -> None:
    cost = CostModel(cache=CostCache.in_memory())
    cost.record("graph", ["aten", "inductor", "onnxruntime"], {"aten": 1.0, "inductor": 0.5},
                {"onnxruntime": "failed to lower: RuntimeError: boom"})
    names = ["aten", "inductor", "onnxruntime"]
    assert cost.recorded("graph", names) == {"aten": 1.0, "inductor": 0.5}
    assert cost.recorded_failures("graph", names) == {
        "onnxruntime": "failed to lower: RuntimeError: boom"}


def test_a_garbled_record_is_ignored_with_a_warning_and_measured_again(
        own_cache: Path) -> None:
    model, args = cnn()
    autoopt.optimize(model, args, backends=BACKENDS)
    path = own_cache / "costs.json"
    data = json.loads(path.read_text())
    garbled = 0
    for key, entry in data["entries"].items():
        if key.startswith("fastest|backend|") and "onnxruntime" in entry:
            entry["onnxruntime"] = "fast"
            garbled += 1
        for field in ("latency_s", "flops", "matmul_flops"):  # ops', the device's
            if field in entry:
                entry[field] = "fast"
    assert garbled
    path.write_text(json.dumps(data))
    with pytest.warns(UserWarning, match="where measurements belong"):
        fast = autoopt.optimize(model, args, backends=BACKENDS)
    (choice,) = fast.report.backends
    assert not choice.cached and set(choice.seconds) == {"aten", "onnxruntime"}
    assert fast.report.captures[0].method == "export"  # not a capture failure
    assert_same_function(model, fast, args, {})


def test_records_carry_autoopts_version() -> None:
    assert f"autoopt={autoopt.__version__}" in library_versions()


class Scaled(nn.Module):
    """An output scaled by a number computed from a weight, which the ONNX exporter folds
    into a constant of its own."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) * self.fc.weight.pow(2).sum()


def test_two_models_of_one_class_get_their_own_folded_constants_from_the_onnx_cache() -> None:
    x = torch.randn(2, 8)
    for seed in (0, 1):
        torch.manual_seed(seed)
        model = Scaled().eval()
        # constant_fold would fold it first; unverified, a served constant would be wrong.
        fast = autoopt.optimize(model, (x,), backend="onnxruntime", verify=False,
                                disable=("constant_fold",))
        with torch.no_grad():
            torch.testing.assert_close(fast(x), model(x), rtol=1e-5, atol=1e-5)


def test_under_bf16_onnx_runtime_is_skipped_with_why_before_it_is_built(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """ONNX Runtime's CPU provider has no bf16 matrix multiply: the candidate is not built
    (an export and a session, to fail with ONNX Runtime's raw error), it is skipped with that
    reason."""
    if ort.unsupported_dtypes(_bf16_graph(), "cpu") == "":
        pytest.skip("this ONNX Runtime runs bf16 matrix multiplies on the CPU")
    built: list[int] = []
    real = ort.lower
    monkeypatch.setattr(ort, "lower", lambda *a, **k: built.append(1) or real(*a, **k))
    model, args = cnn()
    fast = autoopt.optimize(model, args, backends=BACKENDS, precision="bf16",
                            pass_options={"precision": {"force": True}})
    (choice,) = fast.report.backends
    assert "no bfloat16 matrix multiply" in choice.skipped["onnxruntime"]
    assert not built


def _bf16_graph() -> torch.fx.GraphModule:
    return torch.fx.symbolic_trace(nn.Linear(4, 4).to(torch.bfloat16))
