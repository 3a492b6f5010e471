"""Static int8 (``precision="int8", calibration=batches``): the engines' own quantizers (NNCF
on OpenVINO, ONNX Runtime's QDQ), verified against eager on inputs calibration never saw,
reported op by op, refused with the ops named when no engine's int8 is within the tolerance.

No test asserts which engine is fastest: that is this machine's measurement.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

import autoopt
from autoopt.backends import openvino as ov_backend
from autoopt.backends import static_int8
from autoopt.capture.program import save_program
from autoopt.errors import ConfigError
from autoopt.options.calibration import calibration

from .model_zoo import bert, token_ids

pytestmark = [pytest.mark.filterwarnings("ignore"),
              pytest.mark.skipif(bool(ov_backend.available() or static_int8.nncf_available()),
                                 reason=ov_backend.available() or static_int8.nncf_available()
                                 or "installed")]


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
            nn.Conv2d(16, 32, 3, stride=2, padding=1), nn.ReLU(),
            nn.Conv2d(32, 32, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.head = nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


# The suite runs on aten alone unless AUTOOPT_BACKENDS says otherwise (conftest): static int8
# runs on these.
ENGINES = ("openvino", "onnxruntime")


def cnn() -> nn.Module:
    torch.manual_seed(0)
    return Net().eval()


def images(n: int, batch: int = 2) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randn(batch, 3, 16, 16, generator=generator) for _ in range(n)]


@torch.no_grad()
def test_a_cnn_runs_its_convolutions_in_int8_on_an_engine_that_calibrated() -> None:
    model = cnn()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.randn(2, 3, 16, 16)
    fast = autoopt.optimize(model, (x,), precision="int8", calibration=images(16),
                            backends=("aten", *ENGINES))
    (choice,) = fast.report.backends
    assert choice.chosen in static_int8.ENGINES
    # The report names the quantizer, the ops in int8, the error beside the tolerance and the
    # classifier's agreement on the 2 batches held out of calibration (16 // 8).
    assert f"static int8 by {static_int8.ENGINES[choice.chosen]}" in choice.regions
    assert "Conv" in choice.regions and "in int8" in choice.regions
    assert "tolerance 0.05" in choice.regions and "on the 2 batch(es) held out" in choice.regions
    assert "no calibrated int8 kernels" in choice.skipped["aten"]
    # The same function within int8's tolerance, on fresh inputs too.
    for inputs in (x, torch.randn(2, 3, 16, 16)):
        want = model(inputs)
        assert (fast(inputs) - want).abs().max() <= 0.05 * max(1.0, float(want.abs().max()))
    # A later call of another batch size is a graph of its own, calibrated on the same
    # samples cut to its size.
    x5 = torch.randn(5, 3, 16, 16)
    want = model(x5)
    assert (fast(x5) - want).abs().max() <= 0.05 * max(1.0, float(want.abs().max()))
    assert all(c.chosen in static_int8.ENGINES for c in fast.report.backends)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    # A torch.export program cannot hold the engine's int8 model: saving says so.
    with pytest.raises(autoopt.ModelError, match="static int8"):
        save_program(fast, (x,), {}, "never.pt2")


def padded(i: int) -> torch.Tensor:
    mask = torch.ones(2, 16, dtype=torch.long)
    mask[1, 16 - i:] = 0
    return mask


@torch.no_grad()
def test_an_encoder_runs_its_matmuls_in_int8() -> None:
    torch.manual_seed(0)
    model, (ids,), kwargs = bert()
    # A tokenizer's batches: some rows padded, as verification's fresh inputs are.
    batches = [{"input_ids": token_ids(), "attention_mask": padded(i)} for i in range(16)]
    # A 2-layer encoder of width 32 with random weights: both engines' int8 err 6-13% of
    # its output on randomly padded inputs (2% on the example), over int8's default 5%.
    fast = autoopt.optimize(model, (ids,), kwargs, precision="int8", calibration=batches,
                            backends=ENGINES, tolerance=0.2)
    (choice,) = fast.report.backends
    assert choice.chosen in static_int8.ENGINES
    assert any(op in choice.regions for op in ("MatMul", "FullyConnected", "Gemm"))
    out, want = fast(ids, **kwargs), model(ids, **kwargs)
    scale = max(1.0, float(want.last_hidden_state.abs().max()))
    assert (out.last_hidden_state - want.last_hidden_state).abs().max() <= 0.2 * scale


def test_int8_beyond_the_tolerance_is_refused_in_one_line_naming_the_ops() -> None:
    model = cnn()
    with pytest.raises(ConfigError) as caught:
        autoopt.optimize(model, (torch.randn(2, 3, 16, 16),), precision="int8",
                         tolerance=1e-7, calibration=images(4), backends=ENGINES)
    message = str(caught.value)
    assert "\n" not in message
    assert "no engine's int8 stays within the tolerance 1e-07" in message
    assert "openvino:" in message and "onnxruntime:" in message
    # The graph's convolutions and its linear, each quantized alone.
    named = message.split("The ops int8 errs at most: ")[1]
    assert "alone" in named and ("conv" in named or "addmm" in named or "linear" in named)


def test_the_int8_kernels_equal_the_dequantized_reference_within_rounding(
        tmp_path: Path) -> None:
    """ONNX Runtime's integer kernels (its optimized session fuses each QDQ pair into them)
    against the same file run literally: Quantize, Dequantize, then fp32 ops."""
    import onnxruntime as ort

    model, x = cnn(), torch.randn(2, 3, 16, 16)
    fp32 = tmp_path / "fp32.onnx"
    torch.onnx.export(model, (x,), str(fp32), input_names=["x"], dynamo=False)
    batches = [{"x": b.numpy()} for b in images(8)]
    quantized = static_int8.ort_quantize(fp32, batches, tmp_path)
    assert static_int8.onnx_ops(quantized) == {"Conv": 3, "Gemm": 1}

    def run(level: Any) -> np.ndarray:
        options = ort.SessionOptions()
        options.graph_optimization_level = level
        session = ort.InferenceSession(str(quantized), options,
                                       providers=["CPUExecutionProvider"])
        return session.run(None, {"x": x.numpy()})[0]

    fused = run(ort.GraphOptimizationLevel.ORT_ENABLE_ALL)
    literal = run(ort.GraphOptimizationLevel.ORT_DISABLE_ALL)
    # Rounding: a requantized activation may land one step apart (its scale is about
    # range/255); the logits then differ by about that step times the head's weights.
    step = float(np.abs(literal).max()) / 127
    assert np.abs(fused - literal).max() <= 2 * step
    assert np.abs(literal - model(x).detach().numpy()).max() > 0  # it was quantized


def test_calibration_batches_are_checked_against_the_example_inputs() -> None:
    model, x = cnn(), torch.randn(2, 3, 16, 16)

    def optimize(**options: Any) -> Any:
        return autoopt.optimize(model, (x,), **{"precision": "int8", "backends": ENGINES,
                                                **options})

    with pytest.raises(ConfigError, match="pass precision='int8' with it"):
        optimize(precision=None, calibration=images(2))
    with pytest.raises(ConfigError, match="calibration= is empty"):
        optimize(calibration=[])
    with pytest.raises(ConfigError, match="iterable of batches"):
        optimize(calibration=x)
    with pytest.raises(ConfigError, match=r"calibration batch 1 holds \(2, 3, 8, 8\)"):
        optimize(calibration=[x, torch.randn(2, 3, 8, 8)])
    with pytest.raises(ConfigError, match="without the labels"):
        optimize(calibration=[(x, torch.zeros(2, dtype=torch.long))])
    with pytest.raises(ConfigError, match="name one of them in backends="):
        optimize(calibration=images(2), backends=("aten",))
    with pytest.raises(ConfigError, match="training"):
        autoopt.optimize(model.train(), (x,), precision="int8", calibration=images(2),
                         backends=ENGINES)


def test_a_dataloader_calibrates_and_its_short_last_batch_is_left_out() -> None:
    data = torch.utils.data.TensorDataset(torch.randn(9, 3, 16, 16))
    loader = torch.utils.data.DataLoader(data, batch_size=2)
    taken = calibration(x for (x,) in loader)
    assert len(taken) == 4 and taken.held_out == []
    cut = taken.like((torch.randn(4, 3, 16, 16),), {})
    assert [tuple(a[0].shape) for a, _ in cut.batches] == [(4, 3, 16, 16)] * 2
    assert torch.equal(cut.batches[1][0][0], torch.cat([b[0][0] for b in taken.batches])[4:8])


def test_the_cli_reads_a_folder_of_batches(tmp_path: Path) -> None:
    folder = tmp_path / "calibration"
    folder.mkdir()
    for i, batch in enumerate(images(4)):
        torch.save(batch, folder / f"{i:03d}.pt")
    source = tmp_path / "net.py"
    source.write_text(
        "import torch\nfrom torch import nn\n"
        "def make():\n    torch.manual_seed(0)\n"
        "    return nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Flatten(),"
        " nn.Linear(8 * 14 * 14, 10)).eval()\n")
    done = subprocess.run([sys.executable, "-m", "autoopt", "optimize", f"{source}:make",
                           "--input", "2x3x16x16", "--precision", "int8", "--calibration",
                           str(folder), "--backends", "openvino"],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "static int8 by NNCF" in done.stdout
    refused = subprocess.run([sys.executable, "-m", "autoopt", "optimize", f"{source}:make",
                              "--input", "2x3x16x16", "--calibration", str(folder)],
                             capture_output=True, text=True, timeout=600)
    assert refused.returncode != 0 and "add --precision int8" in refused.stderr
