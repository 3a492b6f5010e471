"""autoopt's own int8/int4 kernels (``passes/block_kernels.py``): activations in int8 per block
of 32, VNNI dot products. Each equals its dequantized reference within fp32 rounding, in any
layout a graph hands it; the precision pass takes one only where it measures faster than
fp32's; a decoder runs on them end to end. They need an x86-64 CPU with AVX-512 VNNI and a C++
compiler: elsewhere these tests skip with the reason ``unavailable()`` gives."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

import autoopt
from autoopt import capture
from autoopt.passes import PassContext, block_kernels
from autoopt.passes.precision import cast_precision

from .test_weight_only import _llama, _Picks, _targets

WHY = block_kernels.unavailable()
pytestmark = pytest.mark.skipif(WHY is not None, reason=f"the block kernels need {WHY}")

PACK = {"int8_blocks": block_kernels.pack_int8, "int4_blocks": block_kernels.pack_int4,
        "fp16_panels": block_kernels.pack_fp16}


def _rounding(reference: torch.Tensor, width: int) -> float:
    """fp32 sums of ``width`` products taken in another order: a few ulps of the largest."""
    largest = float(reference.abs().max()) if reference.numel() else 0.0
    return 4 * width * torch.finfo(torch.float32).eps * max(1.0, largest)


def _at_1_and_2_threads(run: Callable[[], torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """``run()`` at 1 thread and at 2, the caller's thread count put back."""
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = run()
        torch.set_num_threads(2)
        return one, run()
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("kernel", sorted(PACK))
@pytest.mark.parametrize(("out", "width", "leading"), [
    (16, 32, (1,)), (40, 64, (3,)), (768, 768, (1,)), (100, 2048, (2, 5)), (37, 96, (0,))])
def test_each_kernel_equals_its_dequantized_reference(kernel: str, out: int, width: int,
                                                      leading: tuple[int, ...]) -> None:
    """Any row count (none, one, a batch of sequences), an output width that is not a
    multiple of the 16-row panel (padded and cut), with and without a bias."""
    torch.manual_seed(out + width)
    weight, x, bias = torch.randn(out, width) * 0.05, torch.randn(*leading, width), \
        torch.randn(out)
    packed = PACK[kernel](weight)
    dequantized = block_kernels.dequantized(weight, kernel)
    for b in (None, bias):
        got = block_kernels.linear(x, packed, b)
        want = block_kernels.reference(x, dequantized, b, kernel)
        assert got.shape == (*leading, out) and got.dtype == torch.float32
        torch.testing.assert_close(got, want, rtol=0, atol=_rounding(want, width))


@pytest.mark.parametrize("name", ["fp32_linear", "fp32_stream_linear"])
@pytest.mark.parametrize(("out", "width", "rows"), [
    (8, 16, 1), (1280, 768, 1), (37, 45, 2), (100, 2048, 4), (5, 7, 3), (16, 32, 0),
    (70, 48, 6), (9, 33, 5)])
def test_the_fp32_gemv_equals_the_linear(name: str, out: int, width: int, rows: int) -> None:
    """autoopt's fp32 GEMVs (``packed_kernels``' ``fp32_rows``: the weight as the model holds
    it, 8 rows of it at a time; ``fp32_stream``: one row after another, up to 4 activation
    rows a sweep): any width (a tail of fewer than 16 or 32 features, masked), any output
    count (a last strip of fewer than 8 rows), more activation rows than a sweep takes, with
    and without a bias, at 1 and 2 threads alike (each output row is one thread's sum)."""
    torch.manual_seed(out + width + rows)
    weight, x, bias = torch.randn(out, width), torch.randn(rows, width), torch.randn(out)
    op = getattr(torch.ops.autoopt_blocks, name)
    for b in (None, bias):
        want = torch.nn.functional.linear(x.double(), weight.double(),
                                          None if b is None else b.double()).float()
        one, two = _at_1_and_2_threads(lambda b=b: op(x, weight, b))
        assert one.shape == (rows, out) and torch.equal(one, two)
        torch.testing.assert_close(one, want, rtol=0, atol=_rounding(want, width))
    with pytest.raises(RuntimeError, match="contiguous"):
        op(x, weight.t().contiguous().t(), None)  # Conv1D's transposed view: not taken


@pytest.mark.parametrize(("out", "width", "rows"), [
    (8, 16, 1), (1280, 768, 1), (37, 45, 2), (100, 2048, 4), (9, 33, 5)])
def test_the_bf16_gemv_is_the_fp32_one_on_the_widened_weight(out: int, width: int,
                                                              rows: int) -> None:
    """``bf16_stream``: bf16 weights and activations widened to fp32 (exactly), the fp32
    stream's sums, one rounding to bf16 at the end: the same bits as ``fp32_stream`` on the
    widened tensors, rounded; at 1 and 2 threads alike. An fp32 input or weight is refused."""
    torch.manual_seed(out + width + rows)
    weight = torch.randn(out, width).bfloat16()
    x, bias = torch.randn(rows, width).bfloat16(), torch.randn(out)
    op = torch.ops.autoopt_blocks.bf16_stream_linear
    for b in (None, bias):
        wide = torch.ops.autoopt_blocks.fp32_stream_linear(x.float(), weight.float(), b)
        one, two = _at_1_and_2_threads(lambda b=b: op(x, weight, b))
        assert one.dtype == torch.bfloat16 and torch.equal(one, two)
        assert torch.equal(one, wide.bfloat16())
    with pytest.raises(RuntimeError, match="BFloat16"):
        op(x.float(), weight, None)
    with pytest.raises(RuntimeError, match="contiguous"):
        op(x, weight.t().contiguous().t(), None)


@pytest.mark.parametrize("group", [32, 64, 128])
def test_int4_groups_and_the_activation_blocks(group: int) -> None:
    """A group of 64 or 128 features holds two or four activation blocks: each block takes
    its own activation scale and the group's weight scale. A block of zeros (a scale of 0)
    contributes nothing."""
    torch.manual_seed(group)
    weight, x = torch.randn(48, 256) * 0.05, torch.randn(3, 256) * 4
    x[1, 32:64] = 0.0
    got = block_kernels.linear(x, block_kernels.pack_int4(weight, group), None)
    want = block_kernels.reference(x, block_kernels.dequantized(weight, "int4_blocks", group),
                                   None)
    torch.testing.assert_close(got, want, rtol=0, atol=_rounding(want, 256))


def test_the_reference_is_the_weights_and_activations_rounding() -> None:
    """The reference itself: within int8's rounding of the fp32 product, and only that."""
    torch.manual_seed(0)
    weight, x = torch.randn(64, 128) * 0.05, torch.randn(4, 128)
    exact = x @ weight.t()
    int8 = block_kernels.reference(x, block_kernels.dequantized(weight, "int8_blocks"), None)
    error = float((int8 - exact).abs().max())
    assert 0 < error <= 0.02 * float(exact.abs().max())
    assert torch.equal(block_kernels.quantized_activations(torch.zeros(2, 64)),
                       torch.zeros(2, 64))


def test_inputs_in_other_layouts_and_dtypes() -> None:
    """A transposed (non-contiguous) input, a bf16 one (the result in bf16, as a linear's),
    and the thread count: each panel is computed whole by one thread, so 1 and 2 threads
    give the same bits."""
    torch.manual_seed(1)
    weight = torch.randn(96, 64) * 0.05
    packed = block_kernels.pack_int4(weight)
    x = torch.randn(64, 5).t()
    want = block_kernels.linear(x.contiguous(), packed, None)
    assert torch.equal(block_kernels.linear(x, packed, None), want)
    low = block_kernels.linear(x.to(torch.bfloat16), packed, None)
    assert low.dtype == torch.bfloat16
    one, two = _at_1_and_2_threads(lambda: block_kernels.linear(x, packed, None))
    assert torch.equal(one, two)


def _mlp() -> tuple[torch.nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.ReLU(),
                                torch.nn.Linear(96, 32), torch.nn.ReLU(),
                                torch.nn.Linear(32, 48)).eval()
    with torch.no_grad():  # int4's rounding within what the stand-in cost model checks
        for layer in model[::2]:
            layer.weight.mul_(0.2)
    return model, torch.randn(4, 64)


@pytest.mark.parametrize(("precision", "kernel", "op"), [
    ("int8", "int8_blocks", "int8_linear"), ("int4", "int4_blocks", "int4_linear"),
    ("bf16", "fp16_panels", "fp16_linear")])
def test_the_pass_takes_the_kernel_only_where_it_measures_faster_than_fp32(
        precision: str, kernel: str, op: str) -> None:
    """Measured per shape beside fp32's kernels and the precision's others: the linear whose
    measurement it wins runs on it; the one where fp32 wins stays fp32. (bf16: as fp16
    weights, where the CPU has no fast bf16 GEMM.)"""
    model, x = _mlp()
    with torch.no_grad():
        gm = capture.export_graph(model, (x,), {})
    cost = _Picks({96: kernel, 32: "aten", 48: kernel})
    result = cast_precision(gm, PassContext((x,), cost=cost, options={
        "precision": precision, "tolerance": 0.9, "weight_only": precision == "bf16"}))
    assert all(kernel in names for _, names in cost.asked)
    summary = result.graph_module.meta["precision"]
    assert summary.kernels == ((kernel, 2),)
    assert [k.why.startswith(f"{precision} measured slower than fp32") for k in summary.kept] \
        == [True]
    assert _targets(result.graph_module).count(getattr(torch.ops.autoopt_blocks, op).default) \
        == 2
    result.graph_module.recompile()
    with torch.no_grad():
        got, expected = result.graph_module(x), model(x)
    assert (got - expected).abs().max() <= 0.9 * max(1.0, float(expected.abs().max()))


@pytest.mark.parametrize("backend", ["aten", "inductor"])
def test_a_decoder_generates_on_the_kernel_through_each_backend(backend: str) -> None:
    """``optimize`` with the kernel named: every linear of the decode step runs on it, in
    ATen's graph and in Inductor's generated code (which calls the op), and generate makes
    the same tokens as the kernel's own model would: the step graph verified against eager's
    logits within int4's tolerance, the tokens compared to eager's for sanity only. ``force``:
    this model's linears are so small that the kernel and fp32's race within a microsecond
    (33 against 32 us in one run), and a measured refusal is not what is tested here."""
    model = _llama()
    ids = torch.randint(0, model.config.vocab_size, (1, 12))
    fast = autoopt.optimize(model, (ids,), precision="int4", backend=backend,
                            pass_options={"precision": {"kernel": "int4_blocks", "force": True,
                                                        "min_agreement": 0.0}})
    out = fast.generate(ids, max_new_tokens=6, do_sample=False)
    assert out.shape == (1, 18) and torch.equal(out[:, :12], ids)
    assert fast.generation_stats.graph_steps >= 5
    kernels: dict[str, Any] = {}
    for report in fast._generator.reports:
        for capture_ in report.captures:
            summary = getattr(capture_, "precision", None)
            if summary is not None:
                kernels.update(dict(summary.kernels))
    assert set(kernels) == {"int4_blocks"}


def test_engines_that_read_onnx_say_they_cannot_before_exporting() -> None:
    """A graph running one of these kernels has no ONNX translation: ONNX Runtime (and
    OpenVINO) are skipped with that reason, not built through an export that fails."""
    model, x = _mlp()
    fast = autoopt.optimize(model, (x,), precision="int4", backends=("aten", "onnxruntime"),
                            pass_options={"precision": {"kernel": "int4_blocks", "force": True}})
    (choice,) = fast.report.backends
    assert choice.chosen == "aten"
    assert "int4_linear" in choice.skipped["onnxruntime"]
    assert "no translation" in choice.skipped["onnxruntime"]
    with torch.no_grad():
        assert (fast(x) - model(x)).abs().max() <= 0.9 * max(1.0, float(model(x).abs().max()))


def test_a_precision_with_no_faster_kernel_names_every_kernel_tried() -> None:
    """Where fp32 wins every linear, the refusal is one line naming the precision's kernels
    measured and their times, ATen's and autoopt's."""
    model, x = _mlp()
    with torch.no_grad():
        gm = capture.export_graph(model, (x,), {})
    result = cast_precision(gm, PassContext((x,), cost=_Picks({}), options={
        "precision": "int4", "tolerance": 0.9}))
    assert not result.modified and "\n" not in result.note
    assert result.note.startswith("int4 measured slower than fp32 on each of the 3 linear(s) "
                                  "(the first: 200 us against 100 us (aten); its fastest "
                                  "kernel int4, also tried: int4_blocks 200 us)")


@pytest.mark.parametrize(("patch", "says"), [
    ("machine", "an x86-64 CPU with AVX-512 VNNI (this is aarch64)"),
    ("compiler", "a C++ compiler (c++ or g++ on PATH) to build them"),
    ("cpu", "a CPU with AVX-512 VNNI (this one has none)")])
def test_where_they_cannot_run_the_reason_names_what_is_missing(
        monkeypatch: pytest.MonkeyPatch, patch: str, says: str) -> None:
    """Each reason the kernels are not candidates, as the log and the tests' skips say it
    (found before anything is built)."""
    import platform
    import shutil

    if patch == "machine":
        monkeypatch.setattr(platform, "machine", lambda: "aarch64")
    elif patch == "compiler":
        monkeypatch.delenv("CXX", raising=False)
        monkeypatch.setattr(shutil, "which", lambda name: None)
    else:
        monkeypatch.setattr(torch.cpu, "_is_vnni_supported", lambda: False)
    assert block_kernels._loaded() == says
