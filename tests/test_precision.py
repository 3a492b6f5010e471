"""The precision pass: bf16/fp16 casts chosen by measurement, int8 linears, training, masks and
padding, errors."""

from __future__ import annotations

import copy
import importlib
import math
from typing import Any

import pytest
import torch
import torch.nn.functional as F
import transformers
from model_zoo import REAL_MODELS, bert, token_ids
from torch import nn
from torch.fx import GraphModule

import autoopt
from autoopt import capture
from autoopt.check.inputs import input_sets, leaves
from autoopt.errors import ConfigError
from autoopt.options import precision as precision_settings
from autoopt.passes import PassContext, precision_policy
from autoopt.passes.graph import attr
from autoopt.passes.masked_inputs import masked_variants
from autoopt.passes.precision import DEFAULT_TOLERANCE, cast_precision, choose

aten = torch.ops.aten


@pytest.fixture(autouse=True)
def _low_precision_measures_faster(monkeypatch: pytest.MonkeyPatch) -> None:
    """Whether bf16/fp16 is applied on a CPU depends on its measured matmul speed (AMX: yes; an
    AVX-512 CPU without it, or at another thread count: maybe not). The tests pin the answer to
    "faster"; the tests of the other answer pin their own."""
    speeds = {torch.float32: 100e9, torch.bfloat16: 800e9, torch.float16: 800e9}
    monkeypatch.setattr(precision_settings, "matmul_flops", lambda device, dtype: speeds[dtype])
    # In training each op's speed decides (precision_policy): pinned to "faster" as well.
    monkeypatch.setattr(precision_policy, "measure_speed",
                        lambda node, dtype, ctx: precision_policy.Speed(1.0, 0.5))
    monkeypatch.setattr(precision_policy, "step_seconds",
                        lambda graphs, ctx: {k: 0.5 if k == "chosen" else 1.0 for k in graphs})


class Block(nn.Module):
    """linear ─ gelu ─ linear ─ layer_norm: one low-precision region, one fp32 island."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(16, 32)
        self.down = nn.Linear(32, 16)
        self.norm = nn.LayerNorm(16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.down(nn.functional.gelu(self.up(x))))


def _export(model: nn.Module, *args: Any) -> GraphModule:
    with torch.no_grad():
        return capture.export_graph(model, args, {})


def _dtype_of(gm: GraphModule, target: Any) -> torch.dtype:
    (node,) = [n for n in gm.graph.nodes if n.target == target]
    return node.meta["val"].dtype


def assert_within(expected: Any, actual: Any, tolerance: float) -> None:
    """Every floating output within ``tolerance * max(1, max |expected|)`` of fp32, the bound
    verification holds a precision option to."""
    want, got = dict(leaves(expected, "out")), dict(leaves(actual, "out"))
    assert want.keys() == got.keys()
    for key, e in want.items():
        if isinstance(e, torch.Tensor) and e.is_floating_point():
            assert got[key].dtype == e.dtype, key
            scale = max(1.0, float(e.abs().max()))
            torch.testing.assert_close(got[key], e, rtol=0.0, atol=tolerance * scale, msg=key)


def assert_fresh_inputs_within(model: nn.Module, fast: nn.Module, args: tuple[Any, ...],
                               kwargs: dict[str, Any], tolerance: float) -> None:
    for a, k in input_sets(args, kwargs, 2, seed=123)[1:]:  # not the sets verification saw
        with torch.no_grad():
            assert_within(model(*a, **k), fast(*a, **k), tolerance)


# --- the pass on a tiny module ---------------------------------------------------------------


def test_block_runs_linears_in_bf16_and_layer_norm_in_fp32() -> None:
    x = torch.randn(4, 16)
    gm = _export(Block().eval(), x)
    ctx = PassContext((x,), options={"precision": "bf16", "tolerance": 0.05})
    result = cast_precision(gm, ctx)
    assert result.modified and result.counts["bf16_ops"] == 2
    gm = result.graph_module
    gm.recompile()
    linears = [n for n in gm.graph.nodes if n.target == aten.linear.default]
    assert [n.meta["val"].dtype for n in linears] == [torch.bfloat16, torch.bfloat16]
    assert _dtype_of(gm, aten.gelu.default) == torch.bfloat16  # follows its input: no cast
    assert _dtype_of(gm, aten.layer_norm.default) == torch.float32
    # Expected: x ─ to(bf16) ─ linear ─ gelu ─ linear ─ to(fp32) ─ layer_norm: two casts.
    casts = [n for n in gm.graph.nodes if n.target == aten._to_copy.default]
    assert [c.kwargs["dtype"] for c in casts] == [torch.bfloat16, torch.float32]
    # Inference stores the linear weights once in bf16; layer_norm's stay fp32.
    stored = {str(n.target): attr(gm, n).dtype for n in gm.graph.nodes if n.op == "get_attr"}
    assert sum(d == torch.bfloat16 for d in stored.values()) == 4
    assert sum(d == torch.float32 for d in stored.values()) == 2
    summary = gm.meta["precision"]
    assert [k.node for k in summary.kept] == ["layer_norm"]
    assert summary.achieved_error <= 0.05 / 2


class TiedHead(nn.Module):
    """A token embedding that is also the output head (GPT-2's wte / lm_head)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(64, 32)
        self.mix = nn.Linear(32, 32)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.linear(torch.relu(self.mix(self.embed(ids))), self.embed.weight)


def test_a_weight_read_in_fp32_and_in_bf16_is_stored_once_in_each() -> None:
    """GPT-2's output head is its token embedding: the embedding stays fp32 (a gather), the
    head runs bf16, and the shared fp32 weight was cast in the graph at every call (a decode
    step read 154 MB and wrote 77 MB for it: bf16 decoded at 0.77x eager). The bf16 users
    read a copy stored once in bf16; the fp32 ones the weight as it is."""
    ids = torch.randint(0, 64, (2, 8))
    model = TiedHead().eval()
    gm = _export(model, ids)
    result = cast_precision(gm, PassContext((ids,), options={"precision": "bf16",
                                                              "tolerance": 0.05}))
    gm = result.graph_module
    gm.recompile()
    casts = [n for n in gm.graph.nodes if n.target == aten._to_copy.default]
    assert all(c.args[0].op != "get_attr" for c in casts), [c.args for c in casts]
    (head,) = [n for n in gm.graph.nodes if n.target == aten.linear.default
               and tuple(n.meta["val"].shape[-1:]) == (64,)]
    weight = head.args[1]
    assert weight.op == "get_attr" and attr(gm, weight).dtype == torch.bfloat16
    (gather,) = [n for n in gm.graph.nodes if n.target == aten.embedding.default]
    assert attr(gm, gather.args[0]) is model.embed.weight  # the user's, fp32, not copied
    torch.testing.assert_close(attr(gm, weight), model.embed.weight.detach().bfloat16())
    with torch.no_grad():
        assert_within(model(ids), gm(ids), 0.05)


def test_block_optimized_matches_fp32_on_fresh_inputs() -> None:
    model, x = Block().eval(), torch.randn(8, 16)
    fast = autoopt.optimize(model, (x,), precision="bf16", tolerance=2e-2)
    assert fast.report.captures[0].precision is not None
    assert_fresh_inputs_within(model, fast, (x,), {}, 2e-2)
    assert fast(x).dtype == torch.float32  # outputs keep their type


def test_choose_sends_back_the_worst_op_until_the_graph_fits() -> None:
    alone = {"a": 1e-3, "b": 2e-2, "c": 1e-3, "d": 1e-3}
    runs = []

    def error_of(low: set[str]) -> float:  # errors adding in quadrature
        runs.append(low)
        return math.sqrt(sum(alone[n] ** 2 for n in low))

    low, kept, error = choose(list(alone), error_of, budget=1e-2)
    assert low == {"a", "c", "d"} and list(kept) == ["b"] and error <= 1e-2
    assert "alone adds error 0.02" in kept["b"]
    runs.clear()
    assert choose(list(alone), error_of, budget=0.1) == (set(alone), {}, error_of(set(alone)))
    assert len(runs) == 2  # one measurement when everything fits (plus the check's own call)
    assert choose(list(alone), error_of, budget=1e-4)[0] == set()


def test_linear_that_overflows_fp16_is_kept_in_fp32() -> None:
    # The first linear's outputs reach ~1e6, past fp16's 65504; the layer norm brings them
    # back to ~1, where the second linear is fine in fp16.
    model = nn.Sequential(nn.Linear(16, 16), nn.LayerNorm(16), nn.Linear(16, 4)).eval()
    with torch.no_grad():
        model[0].weight.mul_(1e5)  # weights up to 25000: still fp16 values
    x = 4 * torch.randn(8, 16)
    gm = _export(model, x)
    result = cast_precision(gm, PassContext((x,), options={"precision": "fp16",
                                                           "tolerance": 1e-2}))
    assert result.modified
    summary = result.graph_module.meta["precision"]
    assert summary.low_ops == 1
    overflowing = next(k for k in summary.kept if k.op.startswith("linear"))
    assert overflowing.node == "linear" and "alone adds error inf" in overflowing.why
    with torch.no_grad():
        out = torch.fx.Interpreter(result.graph_module).run(x)
        assert_within(model(x), out[0] if isinstance(out, (list, tuple)) else out, 1e-2)


def test_pass_does_nothing_without_precision_or_compute_ops() -> None:
    x = torch.randn(4, 16)
    gm = _export(Block().eval(), x)
    assert not cast_precision(gm, PassContext((x,))).modified
    assert not cast_precision(gm, PassContext((x,), options={"precision": "fp32"})).modified
    norm_only = _export(nn.LayerNorm(16).eval(), x)
    assert not cast_precision(norm_only, PassContext((x,), options={"precision": "bf16"})).modified


def test_precision_on_a_graph_not_from_export_raises() -> None:
    # The request cannot apply (the precision pass needs an export graph): an error naming
    # the capture, not a module that silently runs in fp32.
    model, x = Block().eval(), torch.randn(4, 16)
    with pytest.raises(ConfigError, match=r"precision='bf16' cannot apply.*symbolic_trace.*"
                                          r"torch.export graphs only"):
        autoopt.optimize(model, (x,), precision="bf16", capture=("symbolic_trace",))


def test_inplace_relu_after_conv_is_functionalized_not_cast_around() -> None:
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(inplace=True), nn.Conv2d(8, 4, 3)).eval()
    x = torch.randn(1, 3, 16, 16)
    fast = autoopt.optimize(model, (x,), precision="bf16", tolerance=5e-2)
    summary = fast.report.captures[0].precision
    assert summary is not None and summary.low_ops == 2 and summary.casts == 2
    assert_fresh_inputs_within(model, fast, (x,), {}, 5e-2)


# --- masks and padding -----------------------------------------------------------------------


class AdditiveMask(nn.Module):
    """Attention over padded sequences with the mask idiom of BERT-style code: padded positions
    get ``finfo(float32).min`` added to their scores, which bf16 and fp16 cannot hold."""

    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        q = self.q(x)
        scores = q @ q.transpose(-1, -2) / 4
        scores = scores + (1.0 - mask[:, None, :]) * torch.finfo(torch.float32).min
        return scores.softmax(-1) @ q


class FilledMask(nn.Module):
    """The same with ``masked_fill`` and a fill value of the model's choosing."""

    def __init__(self, fill: float) -> None:
        super().__init__()
        self.q = nn.Linear(16, 16)
        self.fill = fill

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        q = self.q(x)
        scores = (q @ q.transpose(-1, -2) / 4).masked_fill(mask[:, None, :] == 0, self.fill)
        return scores.softmax(-1) @ q


def _padded(mask: torch.Tensor) -> torch.Tensor:
    """Row 0 padded after 4 positions, row 1 all padding (its attention is uniform in fp32)."""
    padded = mask.clone()
    padded[0, 4:] = 0
    padded[1] = 0
    return padded


@pytest.mark.parametrize("disable", [(), ("attention",)], ids=["sdpa", "written_out"])
def test_padded_batch_stays_within_tolerance_in_bf16(disable: tuple[str, ...]) -> None:
    # The example has no padding: measured on it alone, finfo(float32).min cast to bf16 became
    # -inf and a fully padded row attended to nothing instead of uniformly (error 0.55).
    model, x, mask = AdditiveMask().eval(), torch.randn(2, 6, 16), torch.ones(2, 6)
    fast = autoopt.optimize(model, (x, mask), precision="bf16", disable=disable)
    summary = fast.report.captures[0].precision
    assert summary is not None and summary.low_ops >= 2, str(fast.report)
    with torch.no_grad():
        assert_within(model(x, _padded(mask)), fast(x, _padded(mask)), 2e-2)
        assert_within(model(x, mask), fast(x, mask), 2e-2)
    assert summary.masked_sets == 1  # measured on a copy with padding and a fully padded row
    kept = {k.node: k.why for k in summary.kept}
    assert "beyond what bf16 holds" in kept["mul"]  # the mask itself stays fp32
    # Where attention takes it as an argument, the mask enters bf16 clamped to bf16's range,
    # which still swamps every score: a fully padded row attends uniformly, as in fp32.
    graph = fast.specializations[0].graph.graph
    fused = any(n.target == aten.scaled_dot_product_attention.default for n in graph.nodes)
    assert summary.clamped == int(fused)


def test_additive_mask_keeps_attention_in_fp32_under_fp16() -> None:
    # fp16's largest value, 65504, is no mask: scores + mask round against it, so a fully
    # padded row would not attend uniformly. Attention on such a mask stays fp32.
    model, x, mask = AdditiveMask().eval(), torch.randn(2, 6, 16), torch.ones(2, 6)
    fast = autoopt.optimize(model, (x, mask), precision="fp16")
    summary = fast.report.captures[0].precision
    assert summary is not None and summary.low_ops >= 1, str(fast.report)
    with torch.no_grad():
        assert_within(model(x, _padded(mask)), fast(x, _padded(mask)), 1e-2)
    graph = fast.specializations[0].graph.graph
    for node in graph.nodes:
        if node.target == aten.scaled_dot_product_attention.default:
            assert node.meta["val"].dtype == torch.float32
            assert "nor clamp" in {k.node: k.why for k in summary.kept}[node.name]


@pytest.mark.parametrize(("precision", "fill"), [("bf16", torch.finfo(torch.float32).min),
                                                 ("fp16", -1e9)])
def test_masked_fill_beyond_the_low_dtype_is_kept_in_fp32(precision: str, fill: float) -> None:
    # The fill value made the pass raise ("value cannot be converted to type c10::BFloat16
    # without overflow") and the whole model stayed fp32 with only a warning.
    model, x, mask = FilledMask(fill).eval(), torch.randn(2, 6, 16), torch.ones(2, 6)
    tolerance = DEFAULT_TOLERANCE[precision]
    fast = autoopt.optimize(model, (x, mask), precision=precision)
    assert not fast.report.warnings, fast.report.warnings
    summary = fast.report.captures[0].precision
    assert summary is not None and summary.low_ops == 3, str(fast.report)  # q, both matmuls
    assert "beyond what" in {k.node: k.why for k in summary.kept}["masked_fill"]
    graph = fast.specializations[0].graph.graph
    (fill_node,) = [n for n in graph.nodes if n.target == aten.masked_fill.Scalar]
    assert fill_node.meta["val"].dtype == torch.float32 and fill_node.args[2] == fill
    with torch.no_grad():
        assert_within(model(x, _padded(mask)), fast(x, _padded(mask)), tolerance)


def test_masked_rows_that_are_nan_in_fp32_do_not_block_the_pass() -> None:
    # A fill of -inf (which bf16 holds) makes a fully masked row NaN in fp32 as well: the
    # measurement asks for the same NaN there, not an error below the budget.
    model, x, mask = FilledMask(-math.inf).eval(), torch.randn(2, 6, 16), torch.ones(2, 6)
    fast = autoopt.optimize(model, (x, mask), precision="bf16")
    with torch.no_grad():
        expected, actual = model(x, _padded(mask)), fast(x, _padded(mask))
    assert torch.equal(expected.isnan(), actual.isnan()) and bool(expected[1].isnan().all())
    assert_within(expected[0], actual[0], 2e-2)
    summary = fast.report.captures[0].precision
    assert summary is not None and summary.low_ops == 3 and summary.masked_sets == 1


def test_masked_variants_pad_rows_and_mask_a_whole_one() -> None:
    ones, features = torch.ones(2, 4, dtype=torch.int64), torch.randn(2, 4)
    (variant,) = masked_variants((features, ones))
    assert variant[0] is features  # not a mask: untouched
    assert variant[1].tolist() == [[1, 1, 0, 0], [0, 0, 0, 0]]
    assert ones.tolist() == [[1] * 4] * 2  # the example is not written
    padding = torch.zeros(1, 4, dtype=torch.bool)  # True marks padding: True is "masked"
    padded, everything = masked_variants((padding,))  # one row: a second copy masks all of it
    assert padded[0].tolist() == [[False, False, True, True]]
    assert everything[0].tolist() == [[True] * 4]
    # Zeros in an integer tensor may be indices: never turned into ones.
    assert masked_variants((torch.zeros(2, 4, dtype=torch.int64),)) == []


# --- measuring leaves no trace ---------------------------------------------------------------


class Normalized(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(8, 16)
        self.norm = nn.BatchNorm1d(16)
        self.head = nn.Linear(16, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.norm(self.up(x))))


def test_bf16_training_measurement_leaves_batch_norm_statistics_alone() -> None:
    # The measuring runs updated the private copy's statistics: num_batches_tracked 2 after
    # optimize, non-zero running means.
    model = Normalized().train()
    before = copy.deepcopy(model.state_dict())
    fast = autoopt.optimize(model, (torch.randn(16, 8),), precision="bf16", training=True)
    assert fast.report.captures[0].precision is not None, str(fast.report)
    for name, value in model.state_dict().items():
        assert torch.equal(value, before[name]), name
    private = {k.removeprefix("module."): v for k, v in fast.state_dict().items()}
    assert private.keys() == before.keys()
    for name, value in private.items():
        assert torch.equal(value, before[name]), name


# --- real models -----------------------------------------------------------------------------


def _gpt2_without_cache() -> tuple[nn.Module, tuple[Any, ...], dict[str, Any]]:
    # use_cache=False: no DynamicCache output, so torch.export (the pass's input) can take it.
    config = transformers.GPT2Config(vocab_size=128, n_embd=32, n_layer=2, n_head=2,
                                     n_positions=64, bos_token_id=0, eos_token_id=0,
                                     use_cache=False)
    return transformers.GPT2Model(config).eval(), (token_ids(),), {}


@pytest.mark.parametrize("make", [REAL_MODELS["bert"], _gpt2_without_cache,
                                  REAL_MODELS["resnet18"]], ids=["bert", "gpt2", "resnet18"])
def test_real_models_in_bf16_match_fp32_within_tolerance(make: Any) -> None:
    model, args, kwargs = make()
    tolerance = 3e-2
    fast = autoopt.optimize(model, args, kwargs, precision="bf16", tolerance=tolerance)
    capture_record = fast.report.captures[0]
    assert capture_record.method == "export"
    summary = capture_record.precision
    assert summary is not None and summary.low_ops > 0, str(fast.report)
    assert summary.achieved_error <= tolerance
    assert_fresh_inputs_within(model, fast, args, kwargs, tolerance)
    text = str(fast.report)
    assert "precision bf16" in text
    if isinstance(model, transformers.PreTrainedModel):  # layer norms reported as fp32
        assert any(k.op.startswith("layer_norm") for k in summary.kept)
        assert "fp32 layer_norm" in text


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["fp16", "bf16"])
@pytest.mark.parametrize("make", [REAL_MODELS["bert"], _gpt2_without_cache,
                                  REAL_MODELS["resnet18"]], ids=["bert", "gpt2", "resnet18"])
def test_real_models_on_cuda_match_fp32_within_tolerance(make: Any, precision: str) -> None:
    model, args, kwargs = make()
    model = model.cuda()
    args = tuple(a.cuda() for a in args)
    kwargs = {k: v.cuda() for k, v in kwargs.items()}
    fast = autoopt.optimize(model, args, kwargs, precision=precision, tolerance=3e-2)
    assert fast.report.captures[0].precision.low_ops > 0, str(fast.report)
    assert_fresh_inputs_within(model, fast, args, kwargs, 3e-2)


def test_bert_in_forced_fp16_matches_fp32() -> None:
    model, args, kwargs = bert()
    fast = autoopt.optimize(model, args, kwargs, precision="fp16", tolerance=1e-2,
                            pass_options={"precision": {"force": True}})
    assert fast.report.captures[0].precision.low_ops > 0
    assert_fresh_inputs_within(model, fast, args, kwargs, 1e-2)


def test_tighter_tolerance_keeps_more_ops_in_fp32() -> None:
    model, args, kwargs = bert()
    kept = {}
    for tolerance in (3e-2, 1e-3):
        fast = autoopt.optimize(model, args, kwargs, precision="bf16", tolerance=tolerance)
        summary = fast.report.captures[0].precision
        assert summary is not None, str(fast.report)
        kept[tolerance] = {k.node for k in summary.kept if "policy" not in k.why}
        assert_fresh_inputs_within(model, fast, args, kwargs, tolerance)
    assert kept[3e-2] < kept[1e-3]
    assert all(why for why in kept[1e-3])


# --- training --------------------------------------------------------------------------------


class Regressor(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = Block()
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(x))


def _train(model: nn.Module, x: torch.Tensor, y: torch.Tensor, steps: int = 50,
           scaler: torch.amp.GradScaler | None = None) -> list[float]:
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        if scaler is None:
            loss.backward()
            opt.step()
        else:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        losses.append(loss.item())
    return losses


def _training_case(device: str) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    x = torch.randn(64, 16, device=device)
    y = torch.sin(x @ torch.randn(16, 4, device=device))
    return Regressor().to(device).train(), x, y


def test_bf16_training_tracks_fp32_loss_over_50_steps() -> None:
    model, x, y = _training_case("cpu")
    reference = _train(copy.deepcopy(model), x, y)
    fast = autoopt.optimize(copy.deepcopy(model), (x,), precision="bf16", training=True)
    assert fast.report.captures[0].precision.low_ops == 3
    losses = _train(fast, x, y)
    # fp32 master weights: the parameters stay fp32 and receive fp32 gradients.
    assert all(p.dtype == torch.float32 and p.grad is not None and p.grad.dtype == torch.float32
               for p in fast.parameters())
    assert losses[-1] < 0.1 * losses[0]  # it learns
    assert abs(losses[-1] - reference[-1]) <= 0.05 * reference[-1]


def test_forced_fp16_training_works_with_grad_scaler_on_cpu() -> None:
    model, x, y = _training_case("cpu")
    reference = _train(copy.deepcopy(model), x, y)
    fast = autoopt.optimize(copy.deepcopy(model), (x,), precision="fp16", training=True,
                            pass_options={"precision": {"force": True}})
    assert fast.report.captures[0].precision.low_ops == 3
    losses = _train(fast, x, y, scaler=torch.amp.GradScaler("cpu"))
    assert abs(losses[-1] - reference[-1]) <= 0.05 * reference[-1]


@pytest.mark.gpu
def test_fp16_training_with_grad_scaler_tracks_fp32_on_cuda() -> None:
    model, x, y = _training_case("cuda")
    reference = _train(copy.deepcopy(model), x, y)
    fast = autoopt.optimize(copy.deepcopy(model), (x,), precision="fp16", training=True)
    assert fast.report.captures[0].precision.low_ops == 3
    losses = _train(fast, x, y, scaler=torch.amp.GradScaler("cuda"))
    assert abs(losses[-1] - reference[-1]) <= 0.05 * reference[-1]


# --- int8 ------------------------------------------------------------------------------------

# These small layers' int8 kernels measure slower than fp32 (quantizing the input costs more
# than their products): the tests of what int8 computes quantize them anyway.
FORCE = {"precision": {"force": True}}


def test_int8_quantizes_bert_linears_within_tolerance() -> None:
    model, args, kwargs = bert()
    # Every one of the model's 13 linears: merge_linear, which fuses Q/K/V where it measures
    # faster on this machine, would make that count depend on the machine.
    fast = autoopt.optimize(model, args, kwargs, precision="int8", tolerance=5e-2,
                            disable=("merge_linear",), pass_options=FORCE)
    summary = fast.report.captures[0].precision
    assert summary is not None and summary.precision == "int8" and summary.low_ops == 13
    graph = fast.specializations[0].graph.graph
    assert not [n for n in graph.nodes if n.target == aten.linear.default]
    assert_fresh_inputs_within(model, fast, args, kwargs, 5e-2)


def test_int8_quantizes_gpt2_s_conv1d_projections() -> None:
    """GPT-2's projections are transformers' ``Conv1D`` (``addmm(b, x, W)`` with ``W`` stored
    (in, out)); only its tied output head was a linear, so int8 left 16 of 17 in fp32."""
    config = transformers.GPT2Config(vocab_size=128, n_embd=32, n_layer=2, n_head=2,
                                     n_positions=32, bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(config).eval()
    ids = torch.randint(0, 128, (2, 8))
    kwargs = {"use_cache": False}
    fast = autoopt.optimize(model, (ids,), kwargs, precision="int8", tolerance=5e-2,
                            disable=("merge_linear",), pass_options=FORCE)
    summary = fast.report.captures[0].precision
    assert summary is not None and summary.low_ops == 2 * 4 + 1  # 4 per block, and the head
    graph = fast.specializations[0].graph.graph
    assert not [n for n in graph.nodes if n.target == aten.addmm.default]
    assert_fresh_inputs_within(model, fast, (ids,), kwargs, 5e-2)



def test_int8_scales_each_row_of_the_input_on_its_own() -> None:
    """The int8 kernel quantizes its input with one scale; a row of small values next to a row
    of large ones (a batch of decode steps) would round to zeros. Each row gets its own scale,
    and a single row keeps the kernel alone."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 32, bias=False)).eval()
    x = torch.randn(2, 64) * torch.tensor([[100.0], [0.01]])
    fast = autoopt.optimize(model, (x,), precision="int8", tolerance=5e-2, pass_options=FORCE)
    assert fast.report.captures[0].precision.low_ops == 1
    with torch.no_grad():
        small, expected = fast(x)[1], model(x)[1]
    assert (small - expected).abs().max() <= 2e-2 * expected.abs().max()
    one = autoopt.optimize(model, (x[1:],), precision="int8", tolerance=5e-2,
                           pass_options=FORCE)
    targets = [n.target for n in one.specializations[0].graph.graph.nodes]
    assert torch.ops.quantized.linear_dynamic.default in targets
    assert aten.amax.default not in targets

class Int8Against:
    """A cost model that measures int8 against fp32 as given: ``int8_wins`` holds the output
    widths whose int8 kernel wins. It runs every candidate once, so that each computes what
    the fp32 linear does (int8 within its rounding)."""

    def __init__(self, int8_wins: set[int]) -> None:
        self.int8_wins = int8_wins
        self.asked: list[str] = []
        self.cold: list[bool] = []
        self.calls: list[set[int]] = []

    def recorded(self, what: str, names: object) -> None:
        return None

    def fastest(self, what: str, candidates: dict[str, Any], repeats: int = 3,
                cold: bool = False) -> tuple[str, dict[str, float]]:
        self.asked.append(what)
        self.cold.append(cold)
        runs = {name: run() for name, run in candidates.items()}
        # Each candidate sweeps as many weights, each read once: the same number of calls.
        self.calls.append({len(r) for r in runs.values()})
        outputs = {name: r[0] for name, r in runs.items()}
        for name, out in outputs.items():
            torch.testing.assert_close(out, outputs["aten"], rtol=0.05, atol=0.05, msg=name)
        width = outputs["aten"].shape[-1]
        best = "int8" if width in self.int8_wins else "aten"
        return best, {name: 1e-4 if name == best else 2e-4 for name in candidates}


def test_int8_keeps_fp32_where_the_int8_kernel_measures_slower() -> None:
    """On a CPU without VNNI an int8 decode step measured slower than fp32's: each linear's
    int8 kernel is timed against fp32's kernels, and a slower one stays in fp32 with the
    measurement as its reason."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 48), nn.ReLU(), nn.Linear(48, 32)).eval()
    x = torch.randn(4, 64)
    gm = _export(model, x)
    cost = Int8Against({48})
    result = cast_precision(gm, PassContext((x,), cost=cost, options={"precision": "int8"}))
    assert result.modified and len(cost.asked) == 2
    assert all(w.startswith("int8|linear|") for w in cost.asked)
    summary = result.graph_module.meta["precision"]
    assert summary.low_ops == 1
    (kept,) = summary.kept
    assert "int8 measured slower than fp32 here: 200 us against 100 us (aten)" in kept.why
    targets = [n.target for n in result.graph_module.graph.nodes]
    assert targets.count(torch.ops.quantized.linear_dynamic.default) == 1
    assert targets.count(aten.linear.default) == 1
    # Slower everywhere: nothing changes, and the note says why and what forces it.
    gm = _export(model, x)
    result = cast_precision(gm, PassContext((x,), cost=Int8Against(set()),
                                            options={"precision": "int8"}))
    assert not result.modified
    assert "slower than fp32 on each of the 2 linear(s)" in result.note and "force" in result.note
    # force: not measured, every linear in int8 (within the tolerance).
    cost = Int8Against(set())
    result = cast_precision(gm, PassContext((x,), cost=cost, options={
        "precision": "int8", "force": True}))
    assert not cost.asked and result.graph_module.meta["precision"].low_ops == 2


def test_int8_against_fp32_from_memory_times_as_many_calls(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the weights outgrow the cache (a decode step), each candidate sweeps copies of
    the weight from memory: the int8 kernel as many calls as fp32's, not four times as many
    copies of its smaller weight (which kept a Llama-style decoder's linears in fp32)."""
    lowering = importlib.import_module("autoopt.passes.packed_linear")  # not the pass itself
    monkeypatch.setattr(lowering, "cpu_cache_bytes", lambda last_level=False: 1 << 14)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 48), nn.ReLU(), nn.Linear(48, 32)).eval()
    x = torch.randn(1, 64)
    cost = Int8Against({48, 32})
    result = cast_precision(_export(model, x), PassContext((x,), cost=cost, options={
        "precision": "int8"}))
    assert cost.cold == [True, True] and all(w.endswith("|cold") for w in cost.asked)
    assert [len(c) for c in cost.calls] == [1, 1] and min(min(c) for c in cost.calls) > 1
    assert result.graph_module.meta["precision"].low_ops == 2


def test_int8_slower_everywhere_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """Through optimize: the request is not dropped (it was, with a warning, the model in
    fp32); the error names the measurement and the option that quantizes anyway."""
    from autoopt.cost_model import CostModel

    def int8_loses(self: Any, what: str, candidates: dict[str, Any], *args: Any,
                   **kwargs: Any) -> tuple[str, dict[str, float]]:
        if not what.startswith("int8|"):
            return original(self, what, candidates, *args, **kwargs)
        return "aten", {name: 2e-4 if name == "int8" else 1e-4 for name in candidates}

    original, recorded = CostModel.fastest, CostModel.recorded
    monkeypatch.setattr(CostModel, "fastest", int8_loses)
    monkeypatch.setattr(CostModel, "recorded", lambda self, what, names: None if what.startswith(
        "int8|") else recorded(self, what, names))
    model = nn.Sequential(nn.Linear(64, 48), nn.ReLU(), nn.Linear(48, 32)).eval()
    x = torch.randn(4, 64)
    with pytest.raises(ConfigError) as raised:
        autoopt.optimize(model, (x,), precision="int8")
    message = str(raised.value)
    assert message.startswith("precision='int8' cannot apply to this model: int8 measured "
                              "slower than fp32 on each of the 2 linear(s)"), message
    assert "'force': True" in message
    assert "tolerance" not in message  # the measurement decided, not the error


# --- ONNX ------------------------------------------------------------------------------------


def test_onnx_export_carries_fp16_compute_with_fp32_islands(tmp_path: Any) -> None:
    import onnx

    model, x = Block().eval(), torch.randn(4, 16)
    path = tmp_path / "block.onnx"
    report = autoopt.export_onnx(model, (x,), path, precision="fp16")
    assert report.ok  # ORT vs eager fp32, within fp16's default tolerance
    proto = onnx.load(str(path))
    fp32, fp16 = onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16
    casts = [next(a.i for a in n.attribute if a.name == "to")
             for n in proto.graph.node if n.op_type == "Cast"]
    assert casts == [fp16, fp32]  # into the linear region, back out before LayerNormalization
    assert [n.op_type for n in proto.graph.node][-1] == "LayerNormalization"
    assert fp16 in {i.data_type for i in proto.graph.initializer}  # weights stored in fp16
    assert [i.type.tensor_type.elem_type for i in proto.graph.input] == [fp32]
    assert [o.type.tensor_type.elem_type for o in proto.graph.output] == [fp32]
    # The same decisions as the PyTorch module: ORT and the fp16 graph agree closely.
    fast = autoopt.optimize(model, (x,), precision="fp16",
                            pass_options={"precision": {"force": True}})
    with torch.no_grad():
        torch.testing.assert_close(autoopt.onnx_session(path)(x), fast(x), rtol=2e-3, atol=2e-3)


# --- errors ----------------------------------------------------------------------------------


def test_unknown_precision_lists_the_valid_ones() -> None:
    with pytest.raises(ConfigError, match=r"precision='fp8' is not supported; use one of "
                                          r"\[None, 'fp32', 'bf16', 'fp16', 'int8', 'int4'\]"):
        autoopt.OptimizeConfig(precision="fp8")


def test_tolerance_needs_a_precision_and_a_sensible_value() -> None:
    with pytest.raises(ConfigError,
                       match="pass precision='bf16', 'fp16', 'int8' or 'int4' with it"):
        autoopt.OptimizeConfig(tolerance=1e-2)
    with pytest.raises(ConfigError, match=r"tolerance must be a number in \(0, 1\)"):
        autoopt.OptimizeConfig(precision="bf16", tolerance=2.0)


def test_precision_config_sets_verification_tolerance_and_rebuilds_cleanly() -> None:
    cfg = autoopt.OptimizeConfig(precision="bf16", tolerance=1e-2)
    assert cfg.verification_tolerances[torch.float32] == autoopt.Tolerance(rtol=0.0, atol=1e-2)
    assert cfg.resolved_pass_options["precision"] == {"precision": "bf16", "tolerance": 1e-2}
    assert cfg.tolerances == {} and cfg.pass_options == {}  # the config is as given
    looser = autoopt.OptimizeConfig.build(cfg, {"tolerance": 3e-2})
    assert looser.verification_tolerances[torch.float32].atol == 3e-2
    off = autoopt.OptimizeConfig.build(looser, {"tolerance": None, "precision": None})
    assert off.verification_tolerances == {} and "precision" not in off.resolved_pass_options


def test_int8_training_is_rejected() -> None:
    model, x, _ = _training_case("cpu")
    with pytest.raises(ConfigError, match="precision='int8' is for inference"):
        autoopt.optimize(model, (x,), precision="int8", training=True)


def test_int8_on_a_gpu_is_rejected() -> None:
    cfg = autoopt.OptimizeConfig(precision="int8")
    with pytest.raises(ConfigError, match=r"precision='int8' \(dynamic quantization\) runs on "
                                          r"the CPU only; the model is on cuda:0"):
        precision_settings.check_target(cfg, torch.device("cuda:0"), training=False)


def test_fp16_on_a_cpu_where_it_is_slower_is_rejected(monkeypatch: pytest.MonkeyPatch) -> None:
    speeds = {torch.float32: 100e9, torch.float16: 20e9, torch.bfloat16: 800e9}
    monkeypatch.setattr(precision_settings, "matmul_flops", lambda device, dtype: speeds[dtype])
    model, x = Block().eval(), torch.randn(4, 16)
    with pytest.raises(ConfigError, match=r"precision='fp16' on this CPU would be slower than "
                                          r"fp32 \(20 GFLOP/s in fp16 vs 100 in fp32"):
        autoopt.optimize(model, (x,), precision="fp16")


def test_bf16_on_a_cpu_without_fast_bf16_is_rejected(monkeypatch: pytest.MonkeyPatch) -> None:
    """It ran in fp32 with a warning: a module that ignores the request. It raises, as fp16
    does, and ``force`` casts anyway."""
    speeds = {torch.float32: 100e9, torch.bfloat16: 30e9}
    monkeypatch.setattr(precision_settings, "matmul_flops", lambda device, dtype: speeds[dtype])
    model, x = Block().eval(), torch.randn(4, 16)
    with pytest.raises(ConfigError, match=r"precision='bf16' on this CPU would be slower than "
                                          r"fp32 \(30 GFLOP/s in bf16 vs 100 in fp32.*'force'"):
        autoopt.optimize(model, (x,), precision="bf16")
    fast = autoopt.optimize(model, (x,), precision="bf16",
                            pass_options={"precision": {"force": True}})
    assert fast.report.captures[0].precision is not None


class _WritesItsPosition(nn.Module):
    """Writes an input in place like a KV cache step: the position advances each call."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.table = nn.Parameter(torch.randn(6, 16))

    def forward(self, x: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        row = self.table.index_select(0, position)
        position.add_(1)
        return self.fc(x + row)


def test_measuring_runs_do_not_see_each_other_s_input_writes() -> None:
    """The precision pass ran its measuring runs on the same input tensors, so an input the
    graph advances in place (a cache position) ran past its table after a few runs and the
    pass failed (IndexError) instead of measuring."""
    model, x, position = _WritesItsPosition().eval(), torch.randn(4, 16), torch.tensor([3])
    fast = autoopt.optimize(model, (x, position), precision="bf16")
    record = next(p for p in fast.report.captures[0].passes if p.name == "precision")
    assert record.status == "applied", record
    assert position.item() == 3  # optimize never writes the example inputs
    want_position, got_position = torch.tensor([3]), torch.tensor([3])
    with torch.no_grad():
        expected = model(x, want_position)
        actual = fast(x, got_position)
    torch.testing.assert_close(actual, expected, atol=0.05, rtol=0.05)
    assert got_position.item() == want_position.item() == 4
