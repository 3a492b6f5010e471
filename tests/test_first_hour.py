"""What a newcomer's first hour met (issue 41): work whose result goes unused, messages that
say what is wrong in the library's words rather than a dependency's."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from autoopt.backends import onnxruntime as ort
from autoopt.check.report import BackendChoice, CaptureRecord, Report

_ORT_ERROR = ("failed to lower: ModelSpecError: '/tmp/autoopt-onnxruntime-lhkhbjp7/graph.onnx' "
              "is not a readable ONNX model: [ONNXRuntimeError] : 9 : NOT_IMPLEMENTED : Could "
              "not find an implementation for Gemm(13) node with name 'node_linear'")

# whole_graph's reason for not building inductor on a CPU, which the report cut at "for the...".
_HYBRID_DOMINATES = (
    "not built: hybrid, built and verified, runs Inductor's generated code for the same graph "
    "with each GEMM and convolution on the kernel measured fastest among ATen's and the MKL "
    "and oneDNN packed kernels Inductor's freezing calls on a CPU; name backends= to measure "
    "it too")


class _Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(16, 32)
        self.down = nn.Linear(32, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


@pytest.mark.skipif(bool(ort.available()), reason=ort.available() or "")
@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_onnx_runtime_says_up_front_which_dtype_it_cannot_run(dtype: torch.dtype) -> None:
    """A bf16 graph was exported and its session opened (15 s) to fail with ONNX Runtime's
    raw INVALID_GRAPH / NOT_IMPLEMENTED: ``unsupported_dtypes`` says so before building, and
    is right about it: where it says nothing the candidate builds and matches eager, where it
    gives a reason building fails."""
    model = _Mlp().eval().to(dtype)
    x = torch.randn(4, 16, dtype=dtype)
    gm = torch.export.export(model, (x,)).module()
    why = ort.unsupported_dtypes(gm, "cpu")
    with torch.no_grad():
        expected = model(x)
    if dtype == torch.float32:
        assert why == ""
    if why:
        assert str(dtype).removeprefix("torch.") in why and "ONNX Runtime" in why
        with pytest.raises(Exception):  # noqa: B017 - what ORT raises is ORT's to choose
            ort.lower(gm, model.forward, (x,), {}, expected, torch.device("cpu"))(x)
    else:
        run = ort.lower(gm, model.forward, (x,), {}, expected, torch.device("cpu"))
        torch.testing.assert_close(run(x), expected, rtol=0.05, atol=0.05)


def _report() -> Report:
    choice = BackendChoice(
        "whole graph", "aten", {"aten": 3.08e-4, "onnxruntime": 3.2e-4, "inductor": 4.98e-4,
                                "openvino": 7.05e-4},
        {"hybrid": "no autoopt kernel in the graph: it would be the inductor backend",
         "onnxruntime": _ORT_ERROR, "inductor": _HYBRID_DOMINATES}, eager_s=3.08e-4)
    return Report([CaptureRecord("int64[2, 8]", "export", seconds=71.78, backends=[choice])])


def test_the_report_says_the_seconds_are_the_whole_build() -> None:
    """``capture: export (71.78 s)`` read as a 72 s torch.export; it was the whole build."""
    text = str(_report())
    assert "export (71.78 s)" not in text
    assert "capture: export; built in 71.78 s (capture, passes, verification, backend " \
           "choice)" in text


def test_the_backend_choice_is_short_lines() -> None:
    """The backend line ran to about 400 characters: the choice, the timings and each
    candidate not used on lines of their own, wrapped to a terminal's width. A reason is
    never cut: ``not inductor: not built: hybrid, ... generated code for the...`` read as
    the whole of it."""
    report = _report()
    lines = str(report).splitlines()
    assert max(map(len, lines)) <= 100, max(lines, key=len)
    assert "    backend aten for the whole graph" in lines
    text = " ".join(line.strip() for line in lines)
    assert "measured: aten 0.308 ms, onnxruntime 0.32 ms, inductor 0.498 ms, openvino 0.705 " \
           "ms; eager 0.308 ms" in text  # wrapped, not cut
    assert f"not onnxruntime: {_ORT_ERROR} not inductor: {_HYBRID_DOMINATES}" in text
    assert any(line.startswith("      not inductor: not built: hybrid,") for line in lines)
    assert not any(line.endswith("...") for line in lines)
    assert report.backends[0].skipped["onnxruntime"] == _ORT_ERROR


@pytest.mark.parametrize("reason, hints", [
    ("int8 measured slower than fp32 on each of the 2 linear(s) (the first: fc); "
     "pass_options={'precision': {'force': True}} quantizes anyway", 1),
    ("in low precision the graph's error would be 0.3 > 0.02", 1)])
def test_the_force_hint_is_given_once(reason: str, hints: int) -> None:
    """The int8 refusal said ``pass_options={'precision': {'force': True}}`` twice: in the
    pass's reason and again in the error around it."""
    from autoopt.check.report import PassRecord
    from autoopt.errors import ConfigError
    from autoopt.options.config import OptimizeConfig
    from autoopt.options.precision import check_applied

    report = Report([CaptureRecord("x", "export", passes=[
        PassRecord("precision", "unchanged", reason=reason)])])
    with pytest.raises(ConfigError) as error:
        check_applied(OptimizeConfig(precision="int8"), report)
    assert str(error.value).count("'force': True") == hints, str(error.value)
    assert reason in str(error.value)


def test_kineto_s_noise_is_dropped_and_everything_else_kept(
        capfd: pytest.CaptureFixture[str]) -> None:
    import os

    from autoopt.diagnose.quiet import quiet_kineto

    usdt = b"USDT:2026-12-03 18:48:15 28027:28027 SyncActivityProfilerHandler.cpp:39] " \
           b"profiler_start\n"
    no_gpu = b"ERROR:2026-12-03 18:48:15 28027:28027 DeviceProperties.cpp:56] " \
             b"gpuGetDeviceCount failed with code 35\n"
    other = b"ERROR:2026-12-03 18:48:15 28027:28027 CuptiActivityApi.cpp:12] CUPTI failed\n"
    for gpu in (False, True):
        with quiet_kineto(gpu=gpu):
            for line in (usdt, no_gpu, other, b"a line of the user's\n"):
                os.write(2, line)
        err = capfd.readouterr().err
        assert "USDT" not in err and "CUPTI failed" in err and "a line of the user's" in err
        assert ("gpuGetDeviceCount" in err) is gpu  # news where a GPU was asked for


def test_diagnose_prints_nothing_of_the_profiler_s(capfd: pytest.CaptureFixture[str]) -> None:
    """On a CPU machine with the CUDA build of torch, every diagnose printed Kineto's USDT
    lines and ``gpuGetDeviceCount failed`` (nothing to see with a CPU-only build)."""
    import autoopt

    autoopt.diagnose(_Mlp().eval(), torch.randn(2, 16), steps=2, roofline=False)
    err = capfd.readouterr().err
    assert "USDT" not in err and "gpuGetDeviceCount" not in err, err


def test_autoopt_s_inductor_compile_does_not_warn_of_a_missing_cuda_runtime() -> None:
    """The CUDA build of torch on a machine without a GPU logs ``No CUDA runtime is found``
    when Inductor first imports its C++ extension helpers (nothing to see elsewhere)."""
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent("""
        import torch
        from autoopt.backends import inductor
        gm = torch.export.export(torch.nn.Linear(4, 4), (torch.randn(2, 4),)).module()
        inductor.lower(gm, dynamic=False, gradients=False)
        import torch._inductor.codecache, torch.utils.cpp_extension
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    assert "No CUDA runtime is found" not in done.stderr, done.stderr


def test_a_refused_precision_is_decided_before_the_backends_are_timed(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """precision='int8' on a small GPT-2 was refused as slower than fp32 after 85 s of timing
    backends for a module optimize then did not return."""
    from autoopt.compile import specialize
    from autoopt.errors import ConfigError
    from autoopt.passes import precision as precision_pass
    from autoopt.passes.precision_int8 import SLOWER, int8_engine

    if int8_engine() is None:
        pytest.skip("no quantized engine in this PyTorch build")
    monkeypatch.setattr(precision_pass, "slower_than_fp32", lambda gm, ctx, nodes: {
        n.name: f"{SLOWER}200 us against 100 us (aten)" for n in nodes})
    lowered: list[str] = []
    real = specialize.lower_whole_graph
    monkeypatch.setattr(specialize, "lower_whole_graph",
                        lambda *args, **kwargs: lowered.append("lowered") or real(*args,
                                                                                   **kwargs))
    with torch.no_grad(), pytest.raises(ConfigError, match="int8 measured slower"):
        import autoopt

        autoopt.optimize(_Mlp().eval(), (torch.randn(4, 16),), precision="int8",
                         backends=("aten", "onnxruntime"))
    assert lowered == []
