"""ONNX emission and ONNX Runtime deployment: ``export_onnx``, ``onnx_session``, and the
``autoopt export`` / ``autoopt run`` commands.

First a tiny model, what the file and the report must say, and the errors; then the real
models (small configs, random weights) under ORT against eager.
"""

from __future__ import annotations

import dataclasses
import textwrap
from pathlib import Path
from typing import Any

import onnx
import pytest
import torch
import torchvision
from model_zoo import bert, gpt2, mobilenet_v3_small, resnet18
from torch import nn
from torch.utils import _pytree as pytree

import autoopt
from autoopt.check.compare import compare
from autoopt.check.inputs import input_sets
from autoopt.cli import main
from autoopt.errors import first_line


class Scorer(nn.Module):
    """Token ids and a float weight in, a dict of two outputs out."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, 8)
        self.head = nn.Linear(8, 4)
        self.drop = nn.Dropout(0.1)

    def forward(self, ids: torch.Tensor, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        h = self.head(self.drop(self.embed(ids)))  # (B, T, 4)
        return {"logits": h * weight.unsqueeze(-1), "pooled": h.mean(1)}


def _scorer_inputs(batch: int = 2, seq: int = 7) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randint(0, 50, (batch, seq)), torch.randn(batch, seq)


def _assert_session_matches(path: Path, model: nn.Module, args: tuple[Any, ...],
                            kwargs: dict[str, Any], seed: int = 123) -> None:
    """ORT and eager agree on fresh inputs drawn with a seed verification did not use."""
    session = autoopt.onnx_session(path)
    for a, k in input_sets(args, kwargs, 1, seed=seed):
        with torch.no_grad():
            expected = model(*a, **k)
        tensors = [t for t in (*a, *k.values()) if isinstance(t, torch.Tensor)]
        actual = session(*tensors)
        if isinstance(expected, dict):
            expected = tuple(v for v in expected.values() if isinstance(v, torch.Tensor))
        result = compare(expected, actual)
        assert result.ok, result.detail


def test_export_names_dynamic_batch_and_report(tmp_path: Path) -> None:
    ids, weight = _scorer_inputs()
    model = Scorer().train()  # exported for inference; the caller's mode is given back
    path = tmp_path / "scorer.onnx"
    report = autoopt.export_onnx(model, (ids,), path, example_kwargs={"weight": weight},
                                 dynamic="batch")
    assert model.training

    proto = onnx.load(str(path))
    onnx.checker.check_model(proto)
    assert report.exporter == "dynamo" and report.fallback_reason == ""
    assert report.opset == proto.opset_import[0].version
    assert report.inputs == {"ids": ["batch", 7], "weight": ["batch", 7]}
    assert report.outputs == ["logits", "pooled"]
    assert report.nodes_before["Gather"] == 1 and "Dropout" not in report.nodes_before
    assert sum(report.nodes_after.values()) > 0
    assert report.verification.ok and report.verification.inputs_checked == 3
    assert report.dynamic_verification.ok  # at batch 3
    assert report.max_abs_error < 1e-5
    text = str(report)
    assert "exporter: dynamo" in text and "ids[batch, 7]" in text and "after ORT" in text

    model.eval()
    _assert_session_matches(path, model, _scorer_inputs(5), {})


def test_export_builds_no_runtime_backend(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                         ) -> None:
    """The file comes from the graph before any backend: building and timing an ONNX Runtime
    session or an Inductor compile to choose one was most of an export's time, for nothing."""
    built: list[str] = []

    def spy(name: str) -> Any:
        def lower(*args: Any, **kwargs: Any) -> Any:
            built.append(name)
            raise RuntimeError(f"{name} built during export")
        return lower

    monkeypatch.setattr("autoopt.backends.onnxruntime.lower", spy("onnxruntime"))
    monkeypatch.setattr("autoopt.backends.inductor.lower", spy("inductor"))
    report = autoopt.export_onnx(Scorer(), _scorer_inputs(), tmp_path / "m.onnx",
                                 config={"backends": ("aten", "inductor", "onnxruntime")})
    assert report.ok and built == []


def test_an_optimized_module_exports_the_graph_it_runs(tmp_path: Path) -> None:
    ids, weight = _scorer_inputs()
    fast = autoopt.optimize(Scorer().eval(), (ids, weight))
    report = autoopt.export_onnx(fast, (ids, weight), tmp_path / "m.onnx", random_inputs=1)
    assert report.capture_method == "export" and report.verification.inputs_checked == 2
    assert report.inputs == {"ids": [2, 7], "weight": [2, 7]}


def test_torchscript_exporter_on_request(tmp_path: Path) -> None:
    ids, weight = _scorer_inputs()
    report = autoopt.export_onnx(Scorer().eval(), (ids, weight), tmp_path / "ts.onnx",
                                 dynamic=("batch",), exporter="torchscript")
    assert report.exporter == "torchscript"
    assert report.fallback_reason == "exporter='torchscript'"
    assert report.inputs["ids"][0] == "batch" and report.dynamic_verification.ok


class _Pool(nn.Module):
    """A convolution and a spatial mean: ONNX's ReduceMean took its axes as an input in 18."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x).mean((2, 3), keepdim=True)


def test_the_dynamo_exporter_refuses_an_opset_it_cannot_write(tmp_path: Path) -> None:
    """Torch converts its opset-18 graph down, fails on ReduceMean, keeps 18 and only logs."""
    path = tmp_path / "pool.onnx"
    with pytest.raises(autoopt.ConfigError, match=r"opset 17.*ReduceMean"):
        autoopt.export_onnx(_Pool().eval(), (torch.randn(2, 3, 8, 8),), path, opset=17,
                            exporter="dynamo")
    assert not path.exists()


@pytest.mark.slow
def test_the_opset_asked_for_is_the_opset_written(tmp_path: Path) -> None:
    """The issue's reproduction: the TorchScript exporter writes the opset the dynamo one
    could not."""
    model, (x,), _ = mobilenet_v3_small()
    path = tmp_path / "mobilenet.onnx"
    report = autoopt.export_onnx(model, (x,), path, opset=17, random_inputs=1)
    assert onnx.load(str(path)).opset_import[0].version == report.opset == 17
    assert report.exporter == "torchscript" and "ReduceMean" in report.fallback_reason
    assert report.verification.ok and report.max_abs_error < 1e-4


def test_session_callable_by_position_name_and_io_binding(tmp_path: Path) -> None:
    ids, weight = _scorer_inputs()
    model = Scorer().eval()
    path = tmp_path / "scorer.onnx"
    autoopt.export_onnx(model, (ids, weight), path, verify=False)
    ort_path = tmp_path / "ort.onnx"
    session = autoopt.onnx_session(path, threads=1, optimized_model_path=ort_path)
    assert session.providers == ["CPUExecutionProvider"] and ort_path.is_file()
    with torch.no_grad():
        expected = model(ids, weight)
    logits, pooled = session(ids, weight=weight)
    torch.testing.assert_close(logits, expected["logits"])
    # The GPU path (IO binding, outputs shared through DLPack) works on the CPU too.
    session._io_binding = True
    bound = session.run({"ids": ids, "weight": weight})
    torch.testing.assert_close(bound["pooled"], expected["pooled"])
    with pytest.raises(autoopt.InputError, match=r"missing: \['weight'\]"):
        session(ids)
    with pytest.raises(autoopt.InputError, match="Got invalid dimensions"):
        session(ids, torch.randn(2, 9))


def test_weights_over_the_protobuf_limit_go_to_external_data(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("autoopt.export.onnx._PROTOBUF_LIMIT", 0)  # stands for 2 GiB of weights
    path = tmp_path / "big.onnx"
    report = autoopt.export_onnx(Scorer().eval(), _scorer_inputs(), path, random_inputs=1)
    assert report.external_data and (tmp_path / "big.onnx.data").is_file()
    assert report.verification.ok and "external data" in str(report)


def test_a_mismatch_raises_with_the_report_and_keeps_the_file(tmp_path: Path) -> None:
    # No error can be below zero: stands for an exporter that changed the function.
    impossible = {torch.float32: autoopt.Tolerance(rtol=-1.0, atol=-1.0)}
    path = tmp_path / "m.onnx"
    with pytest.raises(autoopt.OnnxVerificationError, match="on the example inputs") as info:
        autoopt.export_onnx(Scorer().eval(), _scorer_inputs(), path, tolerances=impossible)
    assert not info.value.report.ok and path.is_file()


def test_dynamo_captured_model_cannot_be_exported(tmp_path: Path) -> None:
    class Branchy(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if x.sum() > 0:  # data-dependent: no whole graph, Dynamo splits here
                return x * 2
            return x - 1

    with pytest.raises(autoopt.ModelError, match=r"captured by 'dynamo', not as one whole"):
        autoopt.export_onnx(Branchy(), (torch.randn(2, 3),), tmp_path / "b.onnx")
    assert not (tmp_path / "b.onnx").exists()


@pytest.mark.parametrize("kwargs, error, message", [
    ({"dynamic": "time"}, autoopt.ConfigError, "unknown dimension"),
    ({"dynamic": 1}, autoopt.ConfigError, "give a dimension name or a list"),
    ({"exporter": "tf"}, autoopt.ConfigError, "exporter='tf'"),
    ({"path": "/nonexistent/dir/m.onnx"}, autoopt.ConfigError, "does not exist"),
])
def test_bad_arguments(tmp_path: Path, kwargs: dict[str, Any], error: type[Exception],
                       message: str) -> None:
    path = kwargs.pop("path", tmp_path / "m.onnx")
    with pytest.raises(error, match=message):
        autoopt.export_onnx(Scorer().eval(), _scorer_inputs(), path, **kwargs)


def test_dynamic_none_is_no_dynamic_dimension(tmp_path: Path) -> None:
    report = autoopt.export_onnx(Scorer().eval(), _scorer_inputs(), tmp_path / "m.onnx",
                                 dynamic=None)
    assert report.ok


def test_dynamic_batch_needs_an_example_batch_of_two(tmp_path: Path) -> None:
    with pytest.raises(autoopt.InputError, match="size of at least 2"):
        autoopt.export_onnx(Scorer().eval(), _scorer_inputs(batch=1), tmp_path / "m.onnx",
                            dynamic="batch")


def test_missing_or_unreadable_onnx_file(tmp_path: Path) -> None:
    with pytest.raises(autoopt.ModelSpecError, match="no such .onnx file"):
        autoopt.onnx_session(tmp_path / "missing.onnx")
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"not a protobuf")
    with pytest.raises(autoopt.ModelSpecError, match="not a readable ONNX model"):
        autoopt.onnx_session(bad)


def test_cuda_without_a_gpu_provider_is_a_clear_error(tmp_path: Path) -> None:
    import onnxruntime

    if "CUDAExecutionProvider" in onnxruntime.get_available_providers():
        pytest.skip("this onnxruntime has a CUDA provider")
    path = tmp_path / "m.onnx"
    autoopt.export_onnx(Scorer().eval(), _scorer_inputs(), path, verify=False)
    with pytest.raises(autoopt.DeviceError, match="onnxruntime-gpu"):
        autoopt.onnx_session(path, device="cuda")


class Masked(nn.Module):
    """Two integer inputs of one shape: swapped, they still run, and compute garbage."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, 8)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.embed(input_ids) * attention_mask.unsqueeze(-1)


def test_inputs_follow_forward_order_whatever_the_keyword_order(tmp_path: Path) -> None:
    model = Masked().eval()
    ids, mask = torch.randint(2, 50, (2, 5)), torch.randint(0, 2, (2, 5))
    path = tmp_path / "m.onnx"
    report = autoopt.export_onnx(model, (), path, random_inputs=1,
                                 example_kwargs={"attention_mask": mask, "input_ids": ids})
    assert list(report.inputs) == ["input_ids", "attention_mask"]
    session = autoopt.onnx_session(path)
    assert session.input_names == ["input_ids", "attention_mask"]
    with torch.no_grad():
        expected = model(ids, mask)
    torch.testing.assert_close(session(ids, mask), expected)  # called like the model
    torch.testing.assert_close(session(attention_mask=mask, input_ids=ids), expected)


def test_session_binds_a_call_as_python_does(tmp_path: Path) -> None:
    ids, weight = _scorer_inputs()
    model = Scorer().eval()
    path = tmp_path / "scorer.onnx"
    autoopt.export_onnx(model, (ids, weight), path, verify=False)
    session = autoopt.onnx_session(path)
    with pytest.raises(TypeError, match="multiple values for input 'ids'"):
        session(ids, weight, ids=ids)
    with pytest.raises(autoopt.InputError, match="multiple values"):
        session(ids, ids=ids, weight=weight)
    with pytest.raises(autoopt.InputError, match=r"input 'ids' is a list, not a tensor"):
        session([ids, weight])
    # numpy arrays are taken as they are; outputs are torch tensors.
    with torch.no_grad():
        expected = model(ids, weight)
    logits, _ = session(ids.numpy(), weight=weight.numpy())
    torch.testing.assert_close(logits, expected["logits"])


class Pair(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(4, 3)

    def forward(self, xs: list[torch.Tensor]) -> torch.Tensor:
        return self.head(xs[0]) + xs[1]


def test_session_names_the_inputs_a_list_became(tmp_path: Path) -> None:
    xs = [torch.randn(2, 4), torch.randn(2, 3)]
    path = tmp_path / "pair.onnx"
    autoopt.export_onnx(Pair().eval(), (xs,), path, verify=False)
    session = autoopt.onnx_session(path)
    assert session.input_names == ["xs_0", "xs_1"]
    with pytest.raises(autoopt.InputError, match="pass them as xs_0, xs_1"):
        session.run({"xs": xs})


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)).eval()


def test_bf16_is_written_for_runtimes_that_run_it(tmp_path: Path) -> None:
    # ONNX Runtime's CPU provider has no bf16 Gemm: the file is still valid ONNX.
    x = torch.randn(2, 16)
    path = tmp_path / "bf16.onnx"
    report = autoopt.export_onnx(_mlp(), (x,), path, precision="bf16", verify=False)
    onnx.checker.check_model(str(path))
    assert report.nodes_before["Gemm"] == 2 and report.verification is None
    assert "Gemm" in report.ort_error and report.nodes_after == {}
    assert "cannot load the file" in str(report)
    with pytest.raises(autoopt.ConfigError, match=r"cannot load it to verify.*verify=False"):
        autoopt.export_onnx(_mlp(), (x,), path, precision="bf16")
    assert path.is_file()


def test_int8_cannot_be_exported_and_says_why(tmp_path: Path) -> None:
    x = torch.randn(2, 16)
    with pytest.raises(autoopt.ConfigError, match="quantize_dynamic") as info:
        autoopt.export_onnx(_mlp(), (x,), tmp_path / "q.onnx", precision="int8")
    assert "\x1b" not in str(info.value)
    fast = autoopt.optimize(_mlp(), (x,), precision="int8", random_inputs=1,
                            pass_options={"precision": {"force": True}})
    with pytest.raises(autoopt.ConfigError, match="cannot be exported to ONNX"):
        autoopt.export_onnx(fast, (x,), tmp_path / "q.onnx")


def test_options_an_optimized_module_cannot_honour_are_refused(tmp_path: Path) -> None:
    ids, weight = _scorer_inputs()
    fast = autoopt.optimize(Scorer().eval(), (ids, weight), random_inputs=1)
    with pytest.raises(autoopt.ConfigError, match="optimized with precision=None"):
        autoopt.export_onnx(fast, (ids, weight), tmp_path / "m.onnx", precision="fp16")
    with pytest.raises(autoopt.ConfigError, match="config= sets how"):
        autoopt.export_onnx(fast, (ids, weight), tmp_path / "m.onnx", config={"verify": False})


def test_a_dynamic_dimension_no_input_has_is_refused(tmp_path: Path) -> None:
    with pytest.raises(autoopt.ConfigError, match="dynamic='sequence' means dim 1 of an "
                                                  "integer or bool input"):
        autoopt.export_onnx(_mlp(), (torch.randn(2, 16),), tmp_path / "m.onnx",
                            dynamic=("batch", "sequence"))


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux's /proc")
def test_an_unwritable_path_is_refused_before_the_work(tmp_path: Path) -> None:
    with pytest.raises(autoopt.ConfigError, match="cannot write there"):
        autoopt.export_onnx(_mlp(), (torch.randn(2, 16),), "/proc/autoopt_model.onnx")


def test_an_unregistered_dataclass_output_is_exported_with_its_fields_as_outputs(
        tmp_path: Path) -> None:
    @dataclasses.dataclass
    class Output:
        logits: torch.Tensor
        hidden: torch.Tensor

    class Returns(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.head = nn.Linear(4, 3)

        def forward(self, x: torch.Tensor) -> Output:
            h = self.head(x)
            return Output(h.relu(), h)

    report = autoopt.export_onnx(Returns().eval(), (torch.randn(2, 4),), tmp_path / "d.onnx")
    assert report.ok and report.capture_method == "export"
    assert report.outputs == ["logits", "hidden"]
    assert Output not in pytree.SUPPORTED_NODES  # registered only while exporting


def test_exporter_messages_lose_colour_codes_and_are_cut_at_a_word() -> None:
    text = first_line(RuntimeError("\x1b[96mstep 1/3\x1b[0m " + "word " * 80))
    assert text.startswith("step 1/3 word") and text.endswith("word ...")
    assert len(text) <= 304


# --- the command line ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def scorer_onnx(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One exported Scorer (static shapes) shared by the tests that only run it."""
    path = tmp_path_factory.mktemp("onnx") / "scorer.onnx"
    autoopt.export_onnx(Scorer().eval(), _scorer_inputs(), path, verify=False)
    return path


def test_cli_export_then_run_round_trip(tmp_path: Path,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    source = tmp_path / "my_model.py"
    source.write_text(textwrap.dedent("""
        import torch
        from torch import nn

        class Scorer(nn.Module):
            def __init__(self):
                super().__init__()
                self.embed = nn.Embedding(50, 8)
                self.head = nn.Linear(8, 3)

            def forward(self, ids, weight):
                return self.head(self.embed(ids)) * weight.unsqueeze(-1)
    """))
    path = tmp_path / "scorer.onnx"
    assert main(["export", f"{source}:Scorer", "--input", "ids=2x7:int64", "--input",
                 "weight=2x7", "--int-high", "50", "-o", str(path), "--dynamic", "batch"]) == 0
    out = capsys.readouterr().out
    assert "exporter: dynamo" in out and "verification (ORT vs eager): matched" in out
    assert "ids[batch, 7]" in out

    # The dtype of ids comes from the model (int64); --bench times the runs.
    assert main(["run", str(path), "--input", "ids=4x7", "--input", "weight=4x7",
                 "--int-high", "50", "--bench", "5", "--threads", "1"]) == 0
    out = capsys.readouterr().out
    assert "output: float32[4, 7, 3]" in out
    assert "latency: median" in out and "throughput:" in out and "(batch 4)" in out


def test_cli_export_takes_inputs_in_forward_order(tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    source = tmp_path / "masked.py"
    source.write_text(textwrap.dedent("""
        from torch import nn

        class Masked(nn.Module):
            def __init__(self):
                super().__init__()
                self.embed = nn.Embedding(50, 8)

            def forward(self, input_ids, attention_mask):
                return self.embed(input_ids) * attention_mask.unsqueeze(-1)
    """))
    path = tmp_path / "masked.onnx"
    assert main(["export", f"{source}:Masked", "--input", "attention_mask=2x5:int64",
                 "--input", "input_ids=2x5:int64", "--int-high", "50", "-o", str(path)]) == 0
    assert "inputs: input_ids[2, 5], attention_mask[2, 5]" in capsys.readouterr().out
    assert autoopt.onnx_session(path).input_names == ["input_ids", "attention_mask"]


@pytest.mark.parametrize("inputs, message", [
    (["ids=2x7", "ids=2x7", "weight=2x7"], "input 'ids' is given twice"),
    (["2x7", "ids=2x7", "weight=2x7"], "input 'ids' is given twice"),
    (["ids=2x7xq"], "shape must look like"),
    (["ids=2x7:float8"], "unknown dtype"),
    (["idz=2x7", "weight=2x7"], "has no input 'idz'"),
    (["2x7", "2x7", "2x7"], "has only 2 input(s)"),
    (["ids=2x8", "weight=2x7"], "Got invalid dimensions for input: ids"),
])
def test_cli_run_bad_input(scorer_onnx: Path, capsys: pytest.CaptureFixture[str],
                           inputs: list[str], message: str) -> None:
    argv = ["run", str(scorer_onnx), "--int-high", "50"]
    for spec in inputs:
        argv += ["--input", spec]
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_cli_run_unreadable_onnx(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.onnx"
    bad.write_text("hello")
    assert main(["run", str(bad), "--input", "1x3"]) == 2
    assert "is not a readable ONNX model" in capsys.readouterr().err
    assert main(["run", str(tmp_path / "none.onnx"), "--input", "1x3"]) == 2
    assert "no such .onnx file" in capsys.readouterr().err


# --- real models -----------------------------------------------------------------------------


def _small_vit() -> tuple[nn.Module, tuple[Any, ...], dict[str, Any]]:
    model = torchvision.models.vision_transformer.VisionTransformer(
        image_size=32, patch_size=8, num_layers=2, num_heads=2, hidden_dim=32, mlp_dim=64,
        num_classes=10).eval()
    return model, (torch.randn(2, 3, 32, 32),), {}


def _small_mobilenet() -> tuple[nn.Module, tuple[Any, ...], dict[str, Any]]:
    model, _, _ = mobilenet_v3_small()
    return model, (torch.randn(2, 3, 32, 32),), {}  # a smaller image: the same graph


def _gpt2_no_cache() -> tuple[nn.Module, tuple[Any, ...], dict[str, Any]]:
    model, args, _ = gpt2()
    return model, args, {"use_cache": False}


@pytest.mark.slow
@pytest.mark.parametrize("build, dynamic", [
    (resnet18, ("batch",)),
    (_small_mobilenet, ()),
    (_small_vit, ()),
    (bert, ("batch", "sequence")),
    (_gpt2_no_cache, ()),
], ids=["resnet18", "mobilenet_v3_small", "vit", "bert", "gpt2"])
def test_real_models_match_eager_under_ort(tmp_path: Path, build: Any,
                                           dynamic: tuple[str, ...]) -> None:
    model, args, kwargs = build()
    path = tmp_path / "model.onnx"
    report = autoopt.export_onnx(model, args, path, example_kwargs=kwargs, dynamic=dynamic,
                                 random_inputs=1, config={"random_inputs": 1})
    onnx.checker.check_model(str(path))
    assert report.exporter == "dynamo", report.fallback_reason
    assert report.verification.ok, report.verification.detail
    if dynamic:
        assert report.dynamic_verification.ok
        assert all(shape[0] == "batch" for shape in report.inputs.values())
    if "sequence" in dynamic:
        assert report.inputs["input_ids"] == ["batch", "sequence"]


@pytest.mark.gpu
def test_cuda_session_keeps_tensors_on_the_gpu(tmp_path: Path) -> None:
    import onnxruntime

    if not {"CUDAExecutionProvider", "TensorrtExecutionProvider"} & set(
            onnxruntime.get_available_providers()):
        pytest.skip("needs onnxruntime-gpu (pip install 'autoopt[gpu]')")
    model, (x,), _ = resnet18()
    path = tmp_path / "resnet.onnx"
    autoopt.export_onnx(model, (x,), path, dynamic="batch", verify=False)
    session = autoopt.onnx_session(path, device="cuda")
    assert session.providers[-1] == "CPUExecutionProvider"
    x = torch.randn(4, 3, 64, 64, device="cuda")
    y = session(x)
    assert y.device.type == "cuda" and y.shape == (4, 10)
    with torch.no_grad():
        expected = model.cuda()(x)
    torch.testing.assert_close(y, expected, rtol=1e-3, atol=1e-3)
