"""The OpenVINO backend: autoopt's ONNX file compiled by OpenVINO for the CPU, verified against
eager like any candidate, f32 unless ``precision=`` says otherwise.

No test asserts that OpenVINO is fastest: that is this machine's measurement.
"""

from __future__ import annotations

import subprocess
import sys
import threading
from typing import Any

import pytest
import torch
import transformers
from torch import nn

import autoopt
from autoopt.backends import openvino as ov_backend
from autoopt.errors import ConfigError
from autoopt.onnx import cache as onnx_cache

from .checks import assert_same_function
from .model_zoo import bert, token_ids

pytestmark = pytest.mark.filterwarnings("ignore")

needs_openvino = pytest.mark.skipif(
    bool(ov_backend.available()), reason=ov_backend.available() or "installed")


def cnn() -> tuple[nn.Module, tuple[Any, ...], dict[str, Any]]:
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                          nn.Conv2d(8, 8, 3, padding=1), nn.GELU(), nn.AdaptiveAvgPool2d(1),
                          nn.Flatten(), nn.Linear(8, 10))
    return model.eval(), (torch.randn(2, 3, 16, 16),), {}


def gpt2() -> tuple[nn.Module, tuple[Any, ...], dict[str, Any]]:
    config = transformers.GPT2Config(vocab_size=128, n_embd=32, n_layer=2, n_head=2,
                                     n_positions=64)
    return transformers.GPT2LMHeadModel(config).eval(), (token_ids(),), {"use_cache": False}


MODELS = {"cnn": cnn, "bert": bert, "gpt2": gpt2}


@needs_openvino
@pytest.mark.parametrize("name", sorted(MODELS))
def test_openvino_computes_the_models_function(name: str) -> None:
    model, args, kwargs = MODELS[name]()
    fast = autoopt.optimize(model, args, kwargs, backend="openvino")
    assert fast.specializations[0].backend == "openvino"
    (choice,) = fast.report.backends
    assert (choice.graph, choice.chosen, choice.skipped) == ("whole graph", "openvino", {})
    assert "backend openvino for the whole graph" in str(fast.report)
    assert_same_function(model, fast, args, kwargs)


@needs_openvino
def test_openvino_runs_in_f32_unless_asked_otherwise(monkeypatch: pytest.MonkeyPatch) -> None:
    """OpenVINO's CPU default is bf16 where the CPU has it: not the model's function."""
    compiled: list[dict[str, Any]] = []
    import openvino as ov

    real = ov.Core.compile_model

    def spy(self: Any, model: Any, device: str, config: dict[str, Any]) -> Any:
        compiled.append(dict(config))
        return real(self, model, device, config)

    monkeypatch.setattr(ov.Core, "compile_model", spy)
    model, args, kwargs = cnn()
    autoopt.optimize(model, args, kwargs, backend="openvino")
    assert compiled and compiled[0]["INFERENCE_PRECISION_HINT"] == "f32"
    assert compiled[0]["INFERENCE_NUM_THREADS"] == torch.get_num_threads()


@needs_openvino
def test_a_dynamic_batch_is_compiled_once_and_serves_every_size() -> None:
    model, args, kwargs = cnn()
    fast = autoopt.optimize(model, args, kwargs, dynamic=True, backend="openvino")
    (choice,) = fast.report.backends
    assert choice.chosen == "openvino" and not choice.skipped
    for batch in (3, 5, 7):  # (export specializes a size of 1)
        x = torch.randn(batch, 3, 16, 16)
        with torch.no_grad():
            torch.testing.assert_close(fast(x), model(x), rtol=1e-4, atol=1e-5)
    assert len(fast.specializations) == 1


@needs_openvino
def test_calls_from_threads_and_outputs_the_caller_owns() -> None:
    model, args, kwargs = bert()
    fast = autoopt.optimize(model, args, kwargs, backend="openvino")
    inputs = [token_ids(2, 16), token_ids(2, 16)]
    with torch.no_grad():
        expected = [model(ids, attention_mask=torch.ones_like(ids)).last_hidden_state
                    for ids in inputs]
    results: dict[int, Any] = {}

    def call(i: int) -> None:
        with torch.no_grad():
            ids = inputs[i % 2]
            results[i] = fast(ids, attention_mask=torch.ones_like(ids)).last_hidden_state

    threads = [threading.Thread(target=call, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i, out in results.items():
        torch.testing.assert_close(out, expected[i % 2], rtol=1e-4, atol=1e-4)
    # Each call's outputs are its own: the next call does not overwrite them.
    assert results[0].data_ptr() != results[2].data_ptr()


@needs_openvino
def test_weights_written_after_lowering_are_used() -> None:
    model, args, kwargs = cnn()
    fast = autoopt.optimize(model, args, kwargs, backend="openvino")
    with torch.no_grad():
        fast.module[0].weight.mul_(-2.0)
        torch.testing.assert_close(fast(*args), fast.module(*args), rtol=1e-4, atol=1e-5)


@needs_openvino
def test_a_second_optimize_reads_the_onnx_file_from_the_cache(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    monkeypatch.setattr(onnx_cache, "folder", lambda: tmp_path)
    exports: list[int] = []
    from autoopt.onnx import graph as onnx_graph

    real = onnx_graph.write_onnx

    def counted(*a: Any, **k: Any) -> Any:
        exports.append(1)
        return real(*a, **k)

    monkeypatch.setattr(onnx_graph, "write_onnx", counted)
    model, args, kwargs = cnn()
    for _ in range(2):
        fast = autoopt.optimize(model, args, kwargs, backend="openvino")
        assert_same_function(model, fast, args, kwargs)
    assert len(exports) == 1


@needs_openvino
def test_training_skips_openvino_and_forcing_it_raises() -> None:
    model, args, kwargs = cnn()
    model.train()
    fast = autoopt.optimize(model, args, kwargs, training=True,
                            backends=("aten", "openvino"))
    (choice,) = fast.report.backends
    assert choice.chosen == "aten"
    assert "inference only" in choice.skipped["openvino"]
    with pytest.raises(ConfigError, match="inference only"):
        autoopt.optimize(model, args, kwargs, training=True, backend="openvino")


# Run in a process of its own: on failure the process dies of SIGSEGV, which would end the suite.
_MODELS_RELEASED_IN_TURN = """
import gc, signal
import torch
from torch import nn
import autoopt

x = torch.randn(2, 8)
fast = [autoopt.optimize(nn.Sequential(nn.Linear(8, 8), nn.ReLU()).eval(), (x,),
                         backend="openvino") for _ in range(2)]
del fast[0]; gc.collect()  # the first model released first, as a loop of optimizes does
del fast[0]; gc.collect()
signal.signal(signal.SIGUSR1, lambda *_: print("handled", flush=True))
signal.raise_signal(signal.SIGUSR1)  # a handled signal: a child's exit, Ctrl-C
"""


@needs_openvino
def test_a_handled_signal_after_openvino_models_are_released_in_turn() -> None:
    """Each ``openvino.Core`` loaded its own CPU plugin, which puts an alternate signal stack
    on the thread and unmaps it when destroyed: two models released in the order they were
    made left the thread on an unmapped stack, and the next handled signal killed the process
    (the test suite died of it, 35 minutes in, when a child process exited)."""
    done = subprocess.run([sys.executable, "-c", _MODELS_RELEASED_IN_TURN],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    assert done.stdout.strip() == "handled"


def test_missing_openvino_is_skipped_with_its_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    why = "openvino is not installed (pip install openvino)"
    monkeypatch.setattr(ov_backend, "available", lambda: why)
    model, args, kwargs = cnn()
    fast = autoopt.optimize(model, args, kwargs, backends=("aten", "openvino"))
    (choice,) = fast.report.backends
    assert choice.chosen == "aten" and choice.skipped == {"openvino": why}
    assert "not openvino: openvino is not installed" in str(fast.report)
    assert_same_function(model, fast, args, kwargs)
    with pytest.raises(ConfigError, match="not installed"):
        autoopt.optimize(model, args, kwargs, backend="openvino")


@needs_openvino
def test_under_bf16_openvino_runs_its_own_bf16_mode_on_the_fp32_graph(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """precision="bf16": OpenVINO's candidate is the graph before autoopt's casts compiled
    with OpenVINO's bf16 hint, verified under the precision's tolerance."""
    import openvino as ov

    compiled: list[tuple[dict[str, Any], list[str]]] = []
    real = ov.Core.compile_model

    def spy(self: Any, model: Any, device: str, config: dict[str, Any]) -> Any:
        types = sorted({str(op.get_output_element_type(0)) for op in model.get_ops()
                        if op.get_output_size()})
        compiled.append((dict(config), types))
        return real(self, model, device, config)

    monkeypatch.setattr(ov.Core, "compile_model", spy)
    model, args, kwargs = cnn()
    fast = autoopt.optimize(model, args, kwargs, backend="openvino", precision="bf16",
                            pass_options={"precision": {"force": True}})
    (choice,) = fast.report.backends
    assert choice.chosen == "openvino"
    assert "OpenVINO in bf16" in str(fast.report)
    assert fast.report.captures[0].precision is not None  # autoopt's map: aten's graph
    (config, types), = compiled
    assert config["INFERENCE_PRECISION_HINT"] == "bf16"
    assert "<Type: 'bfloat16'>" not in types and "bf16" not in " ".join(types)
    with torch.no_grad():
        out, expected = fast(*args), model(*args)
    assert (out - expected).abs().max() <= 0.05 * expected.abs().max()


@needs_openvino
def test_onnx_runtime_and_openvino_share_one_export_where_the_cache_cannot_hold_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from autoopt.onnx import graph as onnx_graph

    monkeypatch.setattr(onnx_cache, "store", lambda *a: "the exporter computed a weight")
    exports: list[int] = []
    real = onnx_graph.write_onnx
    monkeypatch.setattr(onnx_graph, "write_onnx",
                        lambda *a: exports.append(1) or real(*a))
    model, args, kwargs = bert()
    fast = autoopt.optimize(model, args, kwargs, backends=("onnxruntime", "openvino"))
    (choice,) = fast.report.backends
    assert set(choice.seconds) == {"onnxruntime", "openvino"}
    assert len(exports) == 1
    assert_same_function(model, fast, args, kwargs)
    # The choice's files are gone with it: a later choice (a new shape) exports again.
    with torch.no_grad():
        fast(token_ids(3, 8), attention_mask=torch.ones(3, 8, dtype=torch.long))
    assert len(exports) == 2
