"""attention: hand-written softmax(q k^T * scale + mask) v → scaled_dot_product_attention."""

from __future__ import annotations

import copy

import pytest
import torch
import transformers
from torch import nn

import autoopt
from autoopt.capture.graph import export_graph
from autoopt.passes import PassContext, remove_noops, replace_attention

aten = torch.ops.aten


class Before(nn.Module):
    """q, k, v, mask ─ softmax(q @ k^T * 0.125 + mask) @ v"""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                mask: torch.Tensor) -> torch.Tensor:
        scores = q @ k.transpose(-2, -1) * 0.125 + mask  # (B, H, L, S)
        return torch.softmax(scores, dim=-1) @ v         # (B, H, L, Ev)


class Expected(nn.Module):
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                mask: torch.Tensor) -> torch.Tensor:
        return nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.125)


def qkvm(b: int = 2, h: int = 4, seq: int = 8, d: int = 16) -> tuple[torch.Tensor, ...]:
    q, k, v = (torch.randn(b, h, seq, d) for _ in range(3))
    mask = torch.zeros(b, 1, seq, seq).masked_fill(torch.rand(b, 1, seq, seq) > 0.8, -1e9)
    return q, k, v, mask


def _targets(gm: torch.fx.GraphModule) -> list[object]:
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def test_before_becomes_expected() -> None:
    inputs = qkvm()
    result = replace_attention(export_graph(Before(), inputs, {}), PassContext())
    expected = export_graph(Expected(), inputs, {})
    assert result.counts == {"attention": 1}
    assert _targets(result.graph_module) == _targets(expected)
    sdpa = next(n for n in result.graph_module.graph.nodes
                if n.target is aten.scaled_dot_product_attention.default)
    assert sdpa.kwargs["scale"] == 0.125


def test_matches_eager_on_fresh_inputs() -> None:
    gm = replace_attention(export_graph(Before(), qkvm(), {}), PassContext()).graph_module
    for _ in range(3):
        inputs = qkvm()
        torch.testing.assert_close(gm(*inputs), Before()(*inputs), rtol=1e-5, atol=1e-5)


def test_division_scale_scaled_query_and_no_mask() -> None:
    class Variants(nn.Module):
        def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            a = torch.softmax(torch.matmul(q, k.transpose(2, 3)) / 4.0, dim=-1) @ v
            b = torch.softmax((q * 0.5) @ k.transpose(3, 2), dim=3) @ v
            return a + b

    q, k, v, _ = qkvm()
    gm = export_graph(Variants(), (q, k, v), {})
    result = replace_attention(gm, PassContext())
    assert result.counts == {"attention": 2}
    assert aten.softmax.int not in _targets(result.graph_module)
    torch.testing.assert_close(result.graph_module(q, k, v), Variants()(q, k, v))


@pytest.mark.parametrize("case", ["weights_returned", "softmax_dim", "bool_mask", "broadcast_kv",
                                  "tensor_scale"])
def test_does_not_fire_where_sdpa_would_differ(case: str) -> None:
    class M(nn.Module):
        def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    mask: torch.Tensor) -> object:
            scores = q @ k.transpose(-2, -1)
            if case == "weights_returned":     # output_attentions: the weights are needed
                probs = torch.softmax(scores, -1)
                return probs @ v, probs
            if case == "softmax_dim":
                return torch.softmax(scores, dim=-2) @ v
            if case == "bool_mask":
                return torch.softmax(scores.masked_fill(mask < 0, -1e9), -1) @ v
            if case == "tensor_scale":
                return torch.softmax(scores * mask.sum(), -1) @ v
            return torch.softmax(scores, -1) @ v

    q, k, v, mask = qkvm()
    if case == "broadcast_kv":  # one shared k/v head broadcast against four query heads
        k, v = k[:, :1], v[:, :1]
    gm = export_graph(M(), (q, k, v, mask), {})
    result = replace_attention(gm, PassContext())
    assert not result.modified
    assert aten.scaled_dot_product_attention.default not in _targets(result.graph_module)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["gpt2", "bert"])
def test_transformers_eager_attention_is_replaced_end_to_end(arch: str) -> None:
    if arch == "gpt2":
        config = transformers.GPT2Config(vocab_size=128, n_embd=32, n_layer=2, n_head=2,
                                         n_positions=64, bos_token_id=0, eos_token_id=0)
        config._attn_implementation = "eager"
        model = transformers.GPT2Model(config).eval()
        kwargs = {"use_cache": False}
    else:
        config = transformers.BertConfig(vocab_size=128, hidden_size=32, num_hidden_layers=2,
                                         num_attention_heads=2, intermediate_size=64)
        config._attn_implementation = "eager"
        model = transformers.BertModel(config).eval()
        kwargs = {}
    ids = torch.randint(0, 128, (2, 12))
    mask = torch.ones_like(ids)
    mask[1, 8:] = 0  # padding: the mask matters
    kwargs["attention_mask"] = mask
    reference = copy.deepcopy(model)
    fast = autoopt.optimize(model, (ids,), kwargs)
    assert fast.report.capture_method == "export", str(fast.report)
    assert fast.report.pass_counts.get("attention") == 2, str(fast.report)
    with torch.no_grad():
        other = torch.randint(0, 128, (2, 12))
        torch.testing.assert_close(fast(other, **kwargs).last_hidden_state,
                                   reference(other, **kwargs).last_hidden_state,
                                   rtol=1e-4, atol=1e-5)


def test_runs_after_noops_are_removed() -> None:
    class WithNoops(nn.Module):
        def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            probs = torch.softmax(q @ k.transpose(-1, -2) * 0.25, dim=-1).to(torch.float32)
            return nn.functional.dropout(probs, 0.1, training=False) @ v

    q, k, v, _ = qkvm()
    gm = export_graph(WithNoops(), (q, k, v), {})
    assert not replace_attention(gm, PassContext()).modified
    gm = remove_noops(gm, PassContext()).graph_module
    assert replace_attention(gm, PassContext()).counts == {"attention": 1}


# ── Dynamo and symbolic_trace graphs: torch functions, operators, Tensor methods, modules ──


class Spellings(nn.Module):
    """The same attention as Before, written four ways Dynamo records differently."""

    def __init__(self) -> None:
        super().__init__()
        self.softmax = nn.Softmax(dim=-1)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        a = torch.softmax(torch.matmul(q, k.transpose(2, 3)) / 4.0, dim=-1) @ v
        b = ((q * 0.5) @ k.transpose(3, 2)).softmax(dim=3) @ v           # Tensor methods
        c = nn.functional.softmax(q @ k.transpose(-2, -1) * 0.5, -1).matmul(v)
        d = self.softmax(q.matmul(k.transpose(-1, -2)) / 4.0) @ v        # an nn.Softmax
        return a + b + c + d


def _dynamo_graph(model: nn.Module, inputs: tuple[torch.Tensor, ...]) -> torch.fx.GraphModule:
    """The torch-function-level graph Dynamo hands a backend for ``model``."""
    graphs: list[torch.fx.GraphModule] = []

    def grab(gm: torch.fx.GraphModule, example_inputs: object) -> object:
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    torch.compile(model, backend=grab, fullgraph=True)(*inputs)
    return graphs[0]


def _run_dynamo_graph(gm: torch.fx.GraphModule, **inputs: torch.Tensor) -> torch.Tensor:
    """Run a Dynamo graph by input name: its placeholders (``L_q_``) come in first-use order
    and its result is a tuple."""
    names = [str(n.target) for n in gm.graph.nodes if n.op == "placeholder"]
    return gm(*(inputs[name.removeprefix("L_").removesuffix("_")] for name in names))[0]


def test_dynamo_graph_every_spelling_becomes_sdpa() -> None:
    q, k, v, _ = qkvm()
    model = Spellings()
    gm = _dynamo_graph(model, (q, k, v))
    result = replace_attention(gm, PassContext())
    assert result.counts == {"attention": 4}
    targets = _targets(result.graph_module)
    # The graph keeps its level: the torch function, not the ATen overload.
    assert targets.count(nn.functional.scaled_dot_product_attention) == 4
    assert not any("softmax" in str(t) for t in targets)
    for _ in range(3):
        q, k, v, _ = qkvm()
        torch.testing.assert_close(_run_dynamo_graph(result.graph_module, q=q, k=k, v=v),
                                   model(q, k, v), rtol=1e-5, atol=1e-5)


def test_dynamo_graph_with_mask_matches_eager() -> None:
    gm = _dynamo_graph(Before(), qkvm())
    result = replace_attention(gm, PassContext())
    assert result.counts == {"attention": 1}
    sdpa = next(n for n in result.graph_module.graph.nodes
                if n.target is nn.functional.scaled_dot_product_attention)
    assert sdpa.kwargs["scale"] == 0.125 and sdpa.kwargs["attn_mask"] is not None
    for _ in range(3):
        q, k, v, mask = qkvm()
        torch.testing.assert_close(_run_dynamo_graph(result.graph_module, q=q, k=k, v=v,
                                                     mask=mask),
                                   Before()(q, k, v, mask), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("case", ["weights_returned", "softmax_dim", "implicit_dim",
                                  "floor_division"])
def test_dynamo_graph_does_not_fire_where_sdpa_would_differ(case: str) -> None:
    class M(nn.Module):
        def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> object:
            scores = q @ k.transpose(-2, -1)
            if case == "weights_returned":
                probs = scores.softmax(-1)
                return probs @ v, probs
            if case == "softmax_dim":
                return scores.softmax(dim=-2) @ v
            if case == "implicit_dim":  # F.softmax picks a dim itself (deprecated): not -1
                return nn.functional.softmax(scores, dim=None) @ v
            return torch.softmax(torch.div(scores, 4.0, rounding_mode="floor"), -1) @ v

    q, k, v, _ = qkvm()
    result = replace_attention(_dynamo_graph(M(), (q, k, v)), PassContext())
    assert not result.modified


def test_torch_compile_with_autoopt_backend_fuses_and_matches_eager() -> None:
    model = Before()
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="autoopt")
    compiled(*qkvm())  # compile on the first call
    inputs = qkvm()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        out = compiled(*inputs)
    names = {e.key for e in prof.key_averages()}
    assert "aten::scaled_dot_product_attention" in names
    assert "aten::softmax" not in names
    torch.testing.assert_close(out, model(*inputs), rtol=1e-5, atol=1e-5)


def test_optimize_falling_back_to_dynamo_reports_the_rewrite() -> None:
    class Branchy(Before):
        def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    mask: torch.Tensor) -> torch.Tensor:
            if q.sum() > 1e9:  # data-dependent: neither export nor symbolic_trace takes it
                q = q * 2
            return super().forward(q, k, v, mask)

    fast = autoopt.optimize(Branchy(), qkvm(), {})
    assert fast.report.capture_method == "dynamo", str(fast.report)
    assert fast.report.pass_counts.get("attention") == 1, str(fast.report)
    inputs = qkvm()
    torch.testing.assert_close(fast(*inputs), Before()(*inputs), rtol=1e-5, atol=1e-5)


class _LearnedBiasAttention(nn.Module):
    """Hand-written attention with a learned bias on the scores (T5's relative positions)."""

    def __init__(self, bias: bool, d: int = 16, tokens: int = 5) -> None:
        super().__init__()
        self.q, self.k, self.v = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)
        self.bias = nn.Parameter(torch.randn(tokens, tokens)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.q(x), self.k(x), self.v(x)
        scores = q @ k.transpose(-1, -2) / 4.0
        return torch.softmax(scores if self.bias is None else scores + self.bias, dim=-1) @ v


@pytest.mark.parametrize("bias", [False, True], ids=["plain", "learned-bias"])
def test_a_training_graph_with_fused_attention_can_be_differentiated_twice(bias: bool) -> None:
    """A gradient penalty through the fused attention raised: the fused kernels' backward
    has no derivative, where the hand-written attention it replaced had one."""
    model = _LearnedBiasAttention(bias)
    reference = copy.deepcopy(model)
    x = torch.randn(2, 5, 16)
    fast = autoopt.optimize(model, (x,), training=True)
    (attention,) = [p for p in fast.report.captures[0].passes if p.name == "attention"]
    assert attention.status == "applied"
    for m in (reference, fast):
        m(x).pow(2).sum().backward()  # a plain backward: the fused kernel's own
        inputs = x.clone().requires_grad_()
        (grad,) = torch.autograd.grad(m(inputs).pow(2).sum(), inputs, create_graph=True)
        grad.pow(2).sum().backward()
        m(x).sum().backward(retain_graph=True)
    for name, p in reference.named_parameters():
        torch.testing.assert_close(fast.module.get_parameter(name).grad, p.grad,
                                   rtol=1e-4, atol=1e-5)
