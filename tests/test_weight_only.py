"""Weight-only int8 and int4 linears (passes/weight_only.py) under precision='int8'/'int4':
the kernels against a dequantized reference, each kernel choice verified on tiny decoders, the
choice by measurement, next-token agreement and its refusal, and the settings refused."""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
import torch.nn.functional as F
import transformers
from torch.fx import GraphModule

import autoopt
from autoopt import capture
from autoopt.errors import ConfigError
from autoopt.options.config import OptimizeConfig
from autoopt.options.precision import check_target
from autoopt.passes import PassContext, block_kernels, precision_int8, weight_only
from autoopt.passes.precision import cast_precision

aten = torch.ops.aten
# Tiny layers' quantized kernels measure slower than fp32 here and there: the tests of what
# each kernel computes quantize every linear (force), with the kernel named.
ANY_AGREEMENT = {"force": True, "min_agreement": 0.0}


def _llama() -> transformers.LlamaForCausalLM:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=64)
    return transformers.LlamaForCausalLM(config).eval()


def _gpt2() -> transformers.GPT2LMHeadModel:
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=128, n_embd=64, n_layer=2, n_head=2,
                                     n_positions=32, bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(config).eval()


def _export(model: torch.nn.Module, ids: torch.Tensor) -> GraphModule:
    with torch.no_grad():
        return capture.export_graph(model, (ids,), {"use_cache": False})


def _targets(gm: GraphModule) -> list[Any]:
    return [n.target for n in gm.graph.nodes]


# --- the kernels -----------------------------------------------------------------------------


def test_int8_weight_kernel_equals_its_dequantized_reference() -> None:
    torch.manual_seed(0)
    weight, bias, x = torch.randn(48, 64), torch.randn(48), torch.randn(2, 5, 64)
    q = weight_only.quantize_int8(weight)
    assert q.q.dtype == torch.int8 and q.scales.shape == (48,)
    dequantized = weight_only.dequantize_int8(q)
    # Per output channel: each weight within half a step of its row's scale.
    step = q.scales.float()[:, None]
    assert bool(((dequantized - weight).abs() <= step / 2 + 1e-6).all())
    got = weight_only.linear(x, q, bias)
    # The kernel's input is rounded to bf16 and its output returned from bf16.
    expected = F.linear(x.bfloat16().float(), dequantized, bias)
    assert got.shape == (2, 5, 48) and got.dtype == torch.float32
    torch.testing.assert_close(got, expected, rtol=1e-2, atol=1e-2 * float(expected.abs().max()))


@pytest.mark.parametrize("group", [32, 64, 128])
def test_int4_kernel_equals_its_dequantized_reference(group: int) -> None:
    torch.manual_seed(0)
    weight, x = torch.randn(32, 256), torch.randn(3, 256)
    packed = weight_only.quantize_int4(weight, group)
    assert packed.packed.dtype == torch.uint8 and packed.scale_zeros.shape == (256 // group, 32,
                                                                               2)
    dequantized = weight_only.dequantize_int4(weight, group)
    # Per group: 16 levels over the group's range, each weight within half a step of it.
    grouped = weight.reshape(32, -1, group)
    step = (grouped.amax(-1) - grouped.amin(-1)) / 15
    error = (dequantized - weight).reshape(32, -1, group).abs().amax(-1)
    assert bool((error <= step * 0.51 + 1e-2).all())
    got = weight_only.linear(x, packed, None)
    expected = F.linear(x.bfloat16().float(), dequantized)
    torch.testing.assert_close(got, expected, rtol=1e-2, atol=1e-2 * float(expected.abs().max()))


@pytest.mark.parametrize("offset", [16, 8])
def test_bf16_inputs_that_are_views_reach_the_kernels_as_their_rows(offset: int) -> None:
    """A bf16 input sliced from a wider tensor: ATen's int8 kernel read rows at the input
    width from the first one (wrong rows at a 32-byte offset) and faulted the process on
    another alignment (aligned loads at a 16-byte offset)."""
    torch.manual_seed(0)
    weight = torch.randn(32, 64)
    wide = torch.randn(4, 64 + offset, dtype=torch.bfloat16)
    x = wide[:, offset:]
    assert x.stride(0) != 64
    for packed in (weight_only.quantize_int8(weight), weight_only.quantize_int4(weight, 32)):
        got = weight_only.linear(x, packed, None)
        expected = weight_only.linear(x.contiguous(), packed, None)
        torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_shapes_the_kernels_cannot_take_are_no_candidates() -> None:
    assert not weight_only.int4_fits(torch.zeros(32, 48), 32)  # input width not a group
    assert not weight_only.int8_weight_fits(torch.zeros(32, 40))  # ATen's kernel would crash
    with pytest.raises(ValueError, match="multiple of the group size 32"):
        weight_only.quantize_int4(torch.zeros(32, 48))


def test_an_output_width_int4_cannot_pack_is_padded_and_sliced_back() -> None:
    """ATen packs int4 in tiles of 16 output channels: GPT-2's 50257-wide output head (a third
    of its weights) stayed fp32. Zero rows pad it to a tile; the product is sliced back, as
    the eager call and the graph's nodes compute it."""
    torch.manual_seed(0)
    weight, bias, x = torch.randn(50, 64), torch.randn(50), torch.randn(2, 3, 64)
    assert weight_only.int4_fits(weight, 32)
    packed = weight_only.quantize_int4(weight, 32)
    assert packed.out == 50 and packed.scale_zeros.shape == (2, 64, 2)
    expected = F.linear(x.bfloat16().float(), weight_only.dequantize_int4(weight, 32), bias)
    got = weight_only.linear(x, packed, bias)
    assert got.shape == (2, 3, 50)
    torch.testing.assert_close(got, expected, rtol=1e-2, atol=1e-2 * float(expected.abs().max()))
    # In a graph: the pass's nodes, on a model whose head is 50 wide.
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(),
                                torch.nn.Linear(64, 50)).eval()
    with torch.no_grad():
        gm = capture.export_graph(model, (x,), {})
    result = cast_precision(gm, PassContext((x,), options={"precision": "int4", "force": True,
                                                           "tolerance": 0.9}))
    assert result.counts["int4_linear"] == 2
    with torch.no_grad():
        out, want = result.graph_module(x), model(x)
    assert out.shape == (2, 3, 50)
    torch.testing.assert_close(out, want, rtol=0.0, atol=0.3 * float(want.abs().max()))


# --- each kernel on tiny decoders, verified ---------------------------------------------------


@pytest.mark.parametrize(("model", "precision", "kernel"), [
    (_llama, "int8", "int8"), (_llama, "int8", "int8_fbgemm"), (_llama, "int8", "int8_weight"),
    (_llama, "int4", "int4"),
    (_gpt2, "int8", "int8_weight"), (_gpt2, "int4", "int4"),
    *(pytest.param(m, p, k, marks=pytest.mark.skipif(
        block_kernels.unavailable() is not None,
        reason=f"autoopt's block kernels need {block_kernels.unavailable()}"))
      for m, p, k in [(_llama, "int8", "int8_blocks"), (_llama, "int4", "int4_blocks"),
                      (_gpt2, "int4", "int4_blocks")])])
def test_each_kernel_computes_the_model_within_the_tolerance(model: Any, precision: str,
                                                             kernel: str) -> None:
    """Every linear in the named kernel (GPT-2's are Conv1D: addmm of a weight stored (in,
    out)); the graph then computes the model's logits within the precision's tolerance on
    fresh tokens, not only on those the pass measured."""
    module = model()
    ids = torch.randint(0, module.config.vocab_size, (2, 16))
    gm = _export(module, ids)
    linears = sum(t in (aten.linear.default, aten.addmm.default) for t in _targets(gm))
    tolerance = {"int8": 5e-2, "int4": 0.9}[precision]
    result = cast_precision(gm, PassContext((ids, False), options={  # input_ids, use_cache
        "precision": precision, "tolerance": tolerance, "kernel": kernel, **ANY_AGREEMENT}))
    summary = result.graph_module.meta["precision"]
    assert summary.kernels == ((kernel, linears),) and summary.low_ops == linears
    op = {"int8": torch.ops.quantized.linear_dynamic.default,
          "int8_fbgemm": torch.ops.quantized.linear_dynamic.default,
          "int8_weight": aten._weight_int8pack_mm.default,
          "int4": aten._weight_int4pack_mm_for_cpu.default,
          "int8_blocks": torch.ops.autoopt_blocks.int8_linear.default,
          "int4_blocks": torch.ops.autoopt_blocks.int4_linear.default}[kernel]
    quantized = result.graph_module
    quantized.recompile()
    assert _targets(quantized).count(op) == linears
    assert not {aten.linear.default, aten.addmm.default} & set(_targets(quantized))
    # The logits of the LM head: agreement measured on the example's 32 positions.
    assert summary.agreement is not None and summary.agreement.positions == 32
    fresh = torch.randint(0, module.config.vocab_size, (2, 16), generator=torch.Generator()
                          .manual_seed(7))
    with torch.no_grad():
        expected = module(fresh, use_cache=False).logits
        got = quantized(fresh, False)["logits"]
    assert (got - expected).abs().max() <= tolerance * max(1.0, float(expected.abs().max()))
    if precision == "int8":  # within int8's rounding, far inside the bound
        assert (got - expected).abs().max() <= 2e-2 * float(expected.abs().max())


class _Picks:
    """A cost model that measures as told: ``picks`` maps a linear's output width to the
    kernel that wins for it. Each candidate runs once and must compute the fp32 linear."""

    def __init__(self, picks: dict[int, str]) -> None:
        self.picks = picks
        self.asked: list[tuple[str, tuple[str, ...]]] = []

    def recorded(self, what: str, names: object) -> None:
        return None

    def fastest(self, what: str, candidates: dict[str, Any], repeats: int = 3,
                cold: bool = False) -> tuple[str, dict[str, float]]:
        self.asked.append((what, tuple(candidates)))
        outputs = {name: run()[0] for name, run in candidates.items()}
        for name, out in outputs.items():
            torch.testing.assert_close(out, outputs["aten"], rtol=0.1, atol=0.1, msg=name)
        best = self.picks.get(outputs["aten"].shape[-1], "aten")
        return best, {name: 1e-4 if name == best else 2e-4 for name in candidates}


def test_int8_kernel_of_each_linear_is_chosen_by_measurement() -> None:
    """Every int8 kernel (oneDNN's and FBGEMM's dynamic ones, the weight-only one) is timed
    against fp32's for each shape; each linear gets the one measured fastest, and one where
    fp32 wins stays fp32."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 48), torch.nn.ReLU(),
                                torch.nn.Linear(48, 32), torch.nn.ReLU(),
                                torch.nn.Linear(32, 16), torch.nn.ReLU(),
                                torch.nn.Linear(16, 8)).eval()
    x = torch.randn(4, 64)
    with torch.no_grad():
        gm = capture.export_graph(model, (x,), {})
    cost = _Picks({48: "int8_weight", 32: "int8", 16: "int8_fbgemm"})
    result = cast_precision(gm, PassContext((x,), cost=cost, options={"precision": "int8"}))
    assert [set(names) >= {"aten", "int8", "int8_fbgemm", "int8_weight"}
            for _, names in cost.asked] == [True] * 4
    summary = result.graph_module.meta["precision"]
    assert summary.kernels == (("int8", 1), ("int8_fbgemm", 1), ("int8_weight", 1))
    assert [k.why.startswith("int8 measured slower than fp32") for k in summary.kept] == [True]
    targets = _targets(result.graph_module)
    assert targets.count(aten._weight_int8pack_mm.default) == 1
    assert targets.count(torch.ops.quantized.linear_dynamic.default) == 2
    assert targets.count(aten.linear.default) == 1
    result.graph_module.recompile()
    with torch.no_grad():
        got = result.graph_module(x)
        expected = model(x)
    assert (got - expected).abs().max() <= 5e-2 * max(1.0, float(expected.abs().max()))


def test_int8_linears_the_dynamic_kernel_errs_on_take_the_weight_only_one() -> None:
    """The dynamic kernel quantizes activations too: an outlier feature (here 1000 against
    values near 1, the weight ignoring it) rounds every other feature to zero, and the
    error kept the linear fp32. The weight-only kernel keeps activations in bf16: the linear
    runs in int8 with it."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 32)).eval()
    with torch.no_grad():
        model[0].weight[:, 0] = 0.0
    x = torch.randn(4, 64)
    x[:, 0] = 1000.0
    with torch.no_grad():
        gm = capture.export_graph(model, (x,), {})
    result = cast_precision(gm, PassContext((x,), options={
        "precision": "int8", "tolerance": 5e-2, "force": True}))
    assert result.modified
    summary = result.graph_module.meta["precision"]
    assert summary.kernels == (("int8_weight", 1),) and not summary.kept
    assert summary.achieved_error <= 2.5e-2


class _WritesCache(torch.nn.Module):
    """Writes one linear's result into an input (a KV cache) and returns another's."""

    def __init__(self) -> None:
        super().__init__()
        self.key = torch.nn.Linear(64, 32)
        self.head = torch.nn.Linear(64, 32)

    def forward(self, x: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
        cache.copy_(self.key(x))
        return self.head(x)


def test_what_a_graph_writes_into_its_inputs_is_budgeted_like_its_outputs() -> None:
    """Verification holds a written input (a KV cache) to the tolerance as it does the
    outputs; the pass measured the outputs alone, and quantized a linear whose error went
    only into the cache (a generate step's graph was then refused). Here the key linear's
    weights have an outlier its input never reads: int8 rounds the rest away."""
    torch.manual_seed(0)
    model = _WritesCache().eval()
    with torch.no_grad():
        model.key.weight[:, 0] = 100.0
    x, cache = torch.randn(4, 64), torch.zeros(4, 32)
    x[:, 0] = 0.0
    with torch.no_grad():
        gm = capture.export_graph(model, (x, cache), {})
    result = cast_precision(gm, PassContext((x, cache), options={
        "precision": "int8", "tolerance": 5e-2, "force": True, "kernel": "int8_weight"}))
    summary = result.graph_module.meta["precision"]
    assert summary.kernels == (("int8_weight", 1),)
    assert [k.node for k in summary.kept] == ["linear"]  # the key's, writing the cache
    result.graph_module.recompile()
    written, expected = torch.zeros(4, 32), torch.zeros(4, 32)
    with torch.no_grad():
        result.graph_module(x, written)
        model(x, expected)
    torch.testing.assert_close(written, expected)


# --- through optimize and generate ------------------------------------------------------------


def test_int4_applies_to_a_decoder_and_to_generate_s_steps() -> None:
    """precision='int4' on a tiny Llama: the report shows the int4 linears and the agreement;
    generate runs its prompt and decode graphs in int4 too and produces the tokens asked."""
    model = _llama()
    ids = torch.randint(0, 256, (1, 16))
    with torch.no_grad():
        fast = autoopt.optimize(model, (ids,), precision="int4",
                                pass_options={"precision": ANY_AGREEMENT})
        summary = fast.report.captures[0].precision
        assert summary.precision == "int4" and dict(summary.kernels)["int4"] >= 1
        assert summary.agreement is not None and summary.agreement.positions == 16
        report = str(fast.report)
        assert "int4 weight-only" in report and "next-token agreement" in report
        out = fast.generate(ids, max_new_tokens=6, do_sample=False)
    assert out.shape == (1, 22) and torch.equal(out[:, :16], ids)
    steps = [r.captures[0].precision for r in fast._generator.reports]
    assert steps and all(p is not None and p.precision == "int4" for p in steps)
    assert all(p.agreement is not None for p in steps)


def _slower_above_one_row(gm: GraphModule, ctx: Any, nodes: Any) -> dict[str, str]:
    """``slower_than_fp32`` as an Intel Xeon with AMX measured int4 on a Llama-style decoder:
    slower than fp32 at a prompt's 32 rows per weight, 3-5x faster at a decode step's one."""
    from autoopt.passes.graph import meta_val
    from autoopt.passes.precision_int8 import slower

    def rows(node: Any) -> int:
        return int(torch.Size(meta_val(node.args[0]).shape[:-1]).numel())

    return {n.name: f"{slower('int4')}300 us against 200 us (mkl)" for n in nodes
            if rows(n) > 1}


def test_int4_slower_at_a_prompt_s_rows_runs_in_the_decode_steps(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """int4 was refused by optimize on an Intel Xeon with AMX: measured slower than fp32 on
    each linear at the example prompt's 32 rows, although a decode step at one row ran 3.3x
    eager's tokens/s in int4. A decoder's forward that int4 is slower on runs fp32, its
    quality judged there on all its positions; the decode steps measure for themselves and
    run int4; the prompt step runs its graph in fp32. Where the decode step is slower too,
    the first generate raises; where the agreement is too low, optimize does."""
    from autoopt.passes import precision as precision_pass
    from autoopt.passes.precision import DECODE_DECIDES

    monkeypatch.setattr(precision_pass, "slower_than_fp32", _slower_above_one_row)
    model = _llama()
    ids = torch.randint(0, 256, (1, 16))
    with torch.no_grad():
        fast = autoopt.optimize(model, (ids,), precision="int4",
                                pass_options={"precision": {"min_agreement": 0.0}})
        (record,) = [r for r in fast.report.captures[0].passes if r.name == "precision"]
        assert record.status == "unchanged" and fast.report.captures[0].precision is None
        found = re.match(r"int4 measured slower than fp32 on each of the (\d+) linear\(s\) "
                         r"\(the first: 300 us against 200 us \(mkl\)\) here; ", record.reason)
        assert found and record.reason.endswith(DECODE_DECIDES), record.reason
        linears = int(found.group(1))
        assert DECODE_DECIDES in str(fast.report)
        torch.testing.assert_close(fast(ids).logits, model(ids).logits)  # fp32: faster here
        first = fast.generate(ids, max_new_tokens=6, do_sample=False)
        second = fast.generate(ids, max_new_tokens=6, do_sample=False)
    assert first.shape == (1, 22) and torch.equal(first[:, :16], ids)
    stats = fast.generation_stats
    assert stats.eager_steps == 0 and stats.graph_steps == 6 and stats.note == ""
    steps = {r.captures[0].inputs: r.captures[0].precision for r in fast._generator.reports}
    assert len(steps) == 2
    # The decode step: every linear in int4 (Q/K/V may be merged there). The prompt step:
    # only its output head, which generate runs on the last position alone (one row).
    prompt, decode = sorted(steps.values(), key=lambda p: p.low_ops)
    assert prompt.low_ops == 1 and len(prompt.kept) == linears - 1
    assert decode.low_ops > 1 and decode.kept == () and decode.precision == "int4"
    assert second.shape == first.shape

    # Slower at one row too: the decode step's graph refuses, and the first generate says so.
    monkeypatch.setattr(precision_pass, "slower_than_fp32", lambda gm, ctx, nodes: {
        n.name: "int4 measured slower than fp32 here: 300 us against 200 us (mkl)"
        for n in nodes})
    with torch.no_grad():
        slow = autoopt.optimize(model, (ids,), precision="int4",
                                pass_options={"precision": {"min_agreement": 0.0}})
        with pytest.raises(ConfigError, match="int4 measured slower than fp32 on each of the"):
            slow.generate(ids, max_new_tokens=6, do_sample=False)

    # The quality is judged on the forward's positions, with every linear in int4.
    with torch.no_grad(), pytest.raises(ConfigError, match="refused for this model: int4's "
                                                           "next-token agreement"):
        autoopt.optimize(model, (torch.randint(0, 256, (2, 16)),), {"use_cache": False},
                         precision="int4", pass_options={"precision": {"min_agreement": 1.0}})
    # A model that does not generate: raised by optimize, as before.
    mlp = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(),
                              torch.nn.Linear(64, 8)).eval()
    with torch.no_grad(), pytest.raises(ConfigError, match="'force': True"):
        autoopt.optimize(mlp, (torch.randn(4, 64),), precision="int4")


def test_agreement_below_the_threshold_refuses_the_precision() -> None:
    """int4 on a tiny random Llama agrees with fp32 on most next tokens but not all: asked for
    all, optimize refuses, saying what it measured, what was required and what to pass."""
    model = _llama()
    ids = torch.randint(0, 256, (2, 16))
    with torch.no_grad(), pytest.raises(ConfigError) as raised:
        autoopt.optimize(model, (ids,), {"use_cache": False}, precision="int4",
                         pass_options={"precision": {"force": True, "min_agreement": 1.0}})
    message = str(raised.value)
    assert message.startswith("precision='int4' refused for this model: int4's next-token "
                              "agreement with fp32 given the same tokens: "), message
    assert "of 32 position(s), " in message and "(required 100%)" in message
    assert "largest logit error" in message
    assert "use precision='int8'" in message and "'min_agreement'" in message


def test_agreement_counts_argmax_matches_over_positions() -> None:
    """Strict agreement, and the share judged: a token fp32 scores within 1% of its largest
    logit of its best (a near-tie) counts as agreeing there."""
    expected = torch.tensor([[[0.0, 1.0, 0.5], [2.0, 0.0, 0.0], [0.0, 1.0, 0.99]]])
    actual = torch.tensor([[[0.0, 0.4, 0.6], [2.1, 0.0, 0.0], [0.0, 0.9, 1.0]]])
    measured = weight_only.agreement([expected], [actual], [0])
    assert measured is not None
    assert (measured.agreement, measured.positions) == (pytest.approx(1 / 3), 3)
    assert measured.decided == pytest.approx(2 / 3)  # 1.0 against 0.99: within 0.02
    assert measured.logit_error == pytest.approx(0.6) and measured.logit_scale == 2.0
    assert weight_only.agreement([expected], [actual], []) is None


# --- settings refused -------------------------------------------------------------------------


def test_int4_in_training_or_on_a_gpu_is_a_config_error() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(64, 32))
    with pytest.raises(ConfigError, match=r"precision='int4' is for inference.*'bf16'"):
        autoopt.optimize(model, (torch.randn(4, 64),), precision="int4", training=True)
    cfg = OptimizeConfig(precision="int4")
    with pytest.raises(ConfigError, match=r"CPU only.*'fp16' or 'bf16'"):
        check_target(cfg, torch.device("cuda"), False)


def test_bad_quantization_options_are_config_errors() -> None:
    for options, match in (({"kernel": "int4"}, "not a int8 kernel"),
                           ({"group_size": 48}, "group size is one of"),
                           ({"min_agreement": 2}, r"number in \[0, 1\]")):
        cfg = OptimizeConfig(precision="int8", pass_options={"precision": options})
        with pytest.raises(ConfigError, match=match):
            check_target(cfg, torch.device("cpu"), False)


_FORCE = {"precision": {"force": True}}


def _cnn() -> torch.nn.Module:  # its one linear: 2160 inputs, not a multiple of 32
    return torch.nn.Sequential(torch.nn.Conv2d(3, 16, 3), torch.nn.ReLU(),
                               torch.nn.Conv2d(16, 15, 3), torch.nn.Flatten(),
                               torch.nn.Linear(15 * 12 * 12, 10))


@pytest.mark.parametrize(("model", "x", "precision", "options", "says"), [
    (_cnn, (2, 3, 16, 16), "int4", _FORCE,
     r"no linear layer fits the int4 kernel, which needs an input width that is a multiple of "
     r"the group size 32: this model's \(out, in\) "
     r"are \(10, 2160\); int4 is weight-only for linear layers, and this model's multiply-adds "
     r"are mostly in convolutions\. Use precision='int8' \(any width\), precision='bf16', or "
     r"drop precision=\.$"),
    (lambda: torch.nn.Sequential(torch.nn.Linear(30, 50), torch.nn.ReLU(),
                                 torch.nn.Linear(50, 10)), (4, 30), "int4", {},
     r"no linear layer fits the int4 kernel, .*: this model's \(out, in\) are \(10, 50\), "
     r"\(50, 30\)\. Use precision='int8' \(any width\), or drop precision=\.$"),
    (lambda: torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.ReLU()), (2, 3, 16, 16),
     "int8", _FORCE, r"int8 quantizes linear layers only, and this model has none: its "
                     r"multiply-adds are in convolutions\. Use precision='bf16', or drop "
                     r"precision=\.$"),
    (lambda: torch.nn.Sequential(torch.nn.Linear(40, 32)), (4, 40), "int8",
     {"precision": {"kernel": "int8_weight"}},
     r"no linear layer fits the int8_weight kernel, which needs an input width that is a "
     r"multiple of 16: this model's \(out, in\) are \(32, 40\)\. Leave the kernel option out"),
], ids=["int4-cnn-forced", "int4-widths", "int8-no-linear", "int8-weight-widths"])
def test_a_refusal_says_the_one_reason_that_applied(model: Any, x: tuple[int, ...],
                                                    precision: str, options: dict[str, Any],
                                                    says: str) -> None:
    """The refusal listed every reason a precision can fail for (the tolerance, the training
    step, the measurement) and offered force=True to a caller who had passed it."""
    with pytest.raises(ConfigError) as raised:
        autoopt.optimize(model().eval(), (torch.randn(*x),), precision=precision,
                         pass_options=options)
    message = str(raised.value)
    assert message.startswith(f"precision='{precision}' cannot apply to this model: ")
    assert re.search(says, message), message
    assert "tolerance" not in message and "'force'" not in message, message


def test_fbgemm_named_where_the_build_has_no_second_engine_says_so(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A build whose only x86 engine is the one ``int8`` packs for (or none, ARM) has no
    ``int8_fbgemm`` kernel: asking for it refuses with that reason, not a width."""
    monkeypatch.setattr(precision_int8, "_fbgemm_engine", lambda: None)
    with pytest.raises(ConfigError) as raised:
        autoopt.optimize(torch.nn.Sequential(torch.nn.Linear(64, 32)).eval(),
                         (torch.randn(4, 64),), precision="int8",
                         pass_options={"precision": {"kernel": "int8_fbgemm"}})
    assert "the int8_fbgemm kernel is FBGEMM's, and this PyTorch build has no x86 quantized " \
        "engine besides" in str(raised.value)


def test_a_tolerance_no_linear_meets_is_the_reason_given() -> None:
    with pytest.raises(ConfigError) as raised:
        autoopt.optimize(torch.nn.Sequential(torch.nn.Linear(64, 32)).eval(),
                         (torch.randn(4, 64),), precision="int4", tolerance=1e-9,
                         pass_options=_FORCE)
    assert str(raised.value) == ("precision='int4' cannot apply to this model: each linear in "
                                 "int4 errs past the tolerance 1e-09: pass a larger tolerance=, "
                                 "or drop precision=.")


def test_a_model_that_generates_is_judged_by_its_next_token_agreement(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """bf16 on every linear of an 8-layer random Llama-style decoder errs 1.0% in its logits,
    over half the default 2%: 21 of its decode step's 41 linears stayed fp32 and it decoded at
    fp32's speed. A model with ``generate`` takes the decoder's tolerance, its next-token
    agreement judging (recorded for bf16 too); a tolerance of the user's, training, and a model
    that does not generate keep theirs."""
    from autoopt.options.precision import decoder_tolerance
    from autoopt.passes.precision import DECODER_TOLERANCE, DEFAULT_TOLERANCE

    model = _llama()
    mlp = torch.nn.Sequential(torch.nn.Linear(8, 8)).eval()
    bf16 = OptimizeConfig(precision="bf16")
    assert decoder_tolerance(bf16, model, False).precision_tolerance == DECODER_TOLERANCE["bf16"]
    assert decoder_tolerance(bf16, mlp, False).precision_tolerance == DEFAULT_TOLERANCE["bf16"]
    assert decoder_tolerance(bf16, model, True).tolerance is None
    mine = OptimizeConfig(precision="int8", tolerance=0.01)
    assert decoder_tolerance(mine, model, False).precision_tolerance == 0.01
    assert decoder_tolerance(OptimizeConfig(), model, False).tolerance is None

    ids = torch.randint(0, 256, (1, 16))
    with torch.no_grad():
        fast = autoopt.optimize(model, (ids,), precision="bf16",
                                pass_options={"precision": {"force": True}})
        summary = fast.report.captures[0].precision
        assert summary.tolerance == DECODER_TOLERANCE["bf16"]
        assert summary.agreement is not None and summary.agreement.positions == 16
        assert summary.min_agreement == 0.95 and summary.agreement.decided >= 0.95
        assert "next-token agreement" in str(fast.report)
        fast.generate(ids, max_new_tokens=3, do_sample=False)
    steps = [r.captures[0].precision for r in fast._generator.reports]
    assert steps and all(p is not None and p.tolerance == DECODER_TOLERANCE["bf16"]
                         for p in steps)
    with pytest.raises(ConfigError, match="'min_agreement': 1.5"):
        autoopt.optimize(model, (ids,), precision="bf16",
                         pass_options={"precision": {"min_agreement": 1.5}})
    # Below the agreement required, bf16 is refused as int8 is, with what to do.
    from autoopt.passes import precision as precision_pass

    monkeypatch.setattr(precision_pass, "agreement", lambda expected, actual, indices:
                        weight_only.Agreement(0.5, 16, 0.3, 1.0, 0.5))
    with torch.no_grad(), pytest.raises(ConfigError) as raised:
        autoopt.optimize(model, (ids,), precision="bf16",
                         pass_options={"precision": {"force": True}})
    message = str(raised.value)
    assert message.startswith("precision='bf16' refused for this model: bf16's next-token "
                              "agreement with fp32 given the same tokens: 50.0% of 16"), message
    assert "(required 95%)" in message and "drop precision= for fp32" in message
    assert "use precision=" not in message


def test_fp16_weight_linear_equals_its_rounded_reference() -> None:
    """bf16's weight-only kernel: the weight rounded to fp16 once, the product in fp32 (within
    fp32 rounding of F.linear on that rounded weight); a weight beyond fp16's range is not
    offered it."""
    torch.manual_seed(0)
    weight, bias, x = torch.randn(96, 64) * 0.1, torch.randn(96), torch.randn(3, 5, 64)
    out = precision_int8.fp16_linear(weight, bias)(x)
    reference = F.linear(x, weight.half().float(), bias)
    assert out.dtype == torch.float32 and out.shape == (3, 5, 96)
    torch.testing.assert_close(out, reference, atol=1e-5, rtol=1e-5)
    assert (out - F.linear(x, weight, bias)).abs().max() > 0  # the weight was rounded
    model, ids, options = _llama(), torch.randint(0, 256, (1, 16)), {"weight_only": True}
    assert len(precision_int8.int8_candidates(_export(model, ids), "bf16", options)) == 15
    with torch.no_grad():
        model.lm_head.weight[0, 0] = 1e5
    found = precision_int8.int8_candidates(_export(model, ids), "bf16", options)
    assert len(found) == 14 and all(n.meta["val"].shape[-1] != 256 for n in found)


def test_bf16_without_a_fast_bf16_gemm_runs_a_decoder_on_fp16_weights(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """On a CPU whose bf16 GEMM is slower than fp32's (no AVX-512 BF16, no AMX), bf16 for a
    model that generates holds its linears' weights in fp16 (fp32 activations, no casts), each
    where it measures faster than fp32; a model that does not generate is refused as before,
    and weight_only outside bf16 CPU inference is refused in one line."""
    from autoopt.options import precision as precision_settings

    speeds = {torch.float32: 100e9, torch.bfloat16: 30e9}
    monkeypatch.setattr(precision_settings, "matmul_flops", lambda device, dtype: speeds[dtype])
    model, ids = _llama(), torch.randint(0, 256, (1, 16))
    cfg = check_target(OptimizeConfig(precision="bf16"), torch.device("cpu"), False, model)
    assert cfg.pass_options["precision"]["weight_only"] is True
    mlp = torch.nn.Sequential(torch.nn.Linear(8, 8)).eval()
    with pytest.raises(ConfigError, match="no fast bf16 matmul"):
        check_target(OptimizeConfig(precision="bf16"), torch.device("cpu"), False, mlp)
    with pytest.raises(ConfigError, match="bf16 inference on the CPU"):
        check_target(OptimizeConfig(precision="int8", pass_options={
            "precision": {"weight_only": True}}), torch.device("cpu"), False, model)
    with pytest.raises(ConfigError, match="bf16 inference on the CPU"):
        check_target(OptimizeConfig(precision="bf16", pass_options={
            "precision": {"weight_only": True}}), torch.device("cpu"), True, model)
    # Every linear on the fp16 kernel (force: unmeasured; weight_only as check_target sets
    # it, since force alone casts to bf16), the rest of the graph fp32.
    with torch.no_grad():
        fast = autoopt.optimize(model, (ids,), precision="bf16", pass_options={
            "precision": {"weight_only": True, "force": True}})
        expected, actual = model(ids).logits, fast(ids).logits
        tokens = fast.generate(ids, max_new_tokens=4, do_sample=False)
    summary = fast.report.captures[0].precision
    # Every linear (Q/K/V merged first): none kept fp32.
    assert summary is not None and set(dict(summary.kernels)) == {"fp16_weight"}
    assert summary.low_ops == dict(summary.kernels)["fp16_weight"] >= 9 and not summary.kept
    assert "fp16 weight-only" in str(fast.report)
    torch.testing.assert_close(actual, expected, atol=5e-3, rtol=5e-3)
    assert tokens.shape == (1, 20)
    steps = [r.captures[0].precision for r in fast._generator.reports]
    assert steps and all(p is not None and set(dict(p.kernels)) == {"fp16_weight"}
                         for p in steps)
