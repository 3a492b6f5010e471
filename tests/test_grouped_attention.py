"""grouped_attention: attention on key/value heads repeated per query head (repeat_kv) →
the same attention on the shared heads with ``enable_gqa``."""

from __future__ import annotations

import pytest
import torch
import transformers
from torch import nn

import autoopt
from autoopt.capture.graph import export_graph
from autoopt.passes import PassContext, grouped_attention

aten = torch.ops.aten
UNMEASURED = {"grouped_attention": {"measure": False}}  # the rewrite wherever it applies (CPU)


def repeat_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    """transformers' form: (B, KV, S, D) → (B, KV·groups, S, D), each head copied in place."""
    b, kv, s, d = x.shape
    return x[:, :, None, :, :].expand(b, kv, groups, s, d).reshape(b, kv * groups, s, d)


class Grouped(nn.Module):
    """Query heads over fewer key/value heads, the keys and values repeated to match."""

    def __init__(self, groups: int = 3, causal: bool = False) -> None:
        super().__init__()
        self.groups, self.causal = groups, causal

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        return nn.functional.scaled_dot_product_attention(
            q, repeat_kv(k, self.groups), repeat_kv(v, self.groups), attn_mask=mask,
            is_causal=self.causal, scale=0.25)


def inputs(b: int = 2, kv: int = 2, groups: int = 3, seq: int = 5, cache: int = 7,
           d: int = 16) -> tuple[torch.Tensor, ...]:
    q = torch.randn(b, kv * groups, seq, d)
    k, v = torch.randn(b, kv, cache, d), torch.randn(b, kv, cache, d)
    mask = torch.zeros(b, 1, seq, cache).masked_fill(torch.rand(b, 1, seq, cache) > 0.7,
                                                     float("-inf"))
    mask[..., 0] = 0.0  # every query row sees a position
    return q, k, v, mask


def _sdpa(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    return [n for n in gm.graph.nodes if n.target is aten.scaled_dot_product_attention.default]


def _expands(gm: torch.fx.GraphModule) -> int:
    return sum(n.target is aten.expand.default for n in gm.graph.nodes)


@pytest.mark.parametrize("groups", [1, 3])
def test_repeated_keys_and_values_become_grouped_attention(groups: int) -> None:
    args = inputs(groups=groups)
    gm = export_graph(Grouped(groups), args, {})
    assert _expands(gm) == 2
    result = grouped_attention(gm, PassContext())
    assert result.counts == {"grouped_attention": 1}
    (sdpa,) = _sdpa(result.graph_module)
    assert sdpa.kwargs["enable_gqa"] is True and sdpa.kwargs["scale"] == 0.25
    assert _expands(result.graph_module) == 0  # the copies are gone, not only unused
    for fresh in (args, inputs(groups=groups)):
        torch.testing.assert_close(result.graph_module(*fresh), Grouped(groups)(*fresh),
                                   rtol=1e-5, atol=1e-5)


def test_causal_attention_without_a_mask() -> None:
    q, k, v, _ = inputs(seq=7)
    gm = export_graph(Grouped(causal=True), (q, k, v), {})
    result = grouped_attention(gm, PassContext())
    assert result.counts == {"grouped_attention": 1}
    torch.testing.assert_close(result.graph_module(q, k, v), Grouped(causal=True)(q, k, v),
                               rtol=1e-5, atol=1e-5)


def test_measured_where_a_cost_model_is_given() -> None:
    """With a cost model, the choice is each shape's measurement: the pass asks it, once per
    distinct shape, and does what it answers."""

    class Answers:
        def __init__(self, best: str) -> None:
            self.best, self.asked = best, []

        def fastest(self, what: str, candidates: dict) -> tuple[str, dict]:
            self.asked.append(what)
            results = {name: fn() for name, fn in candidates.items()}
            torch.testing.assert_close(results["grouped"], results["repeated"])
            return self.best, {name: 1.0 for name in candidates}

    args = inputs()
    for best, fired in (("grouped", 1), ("repeated", 0)):
        cost = Answers(best)
        result = grouped_attention(export_graph(Grouped(), args, {}), PassContext(cost=cost))
        assert len(cost.asked) == 1 and "q(2, 6, 5, 16)|kv(2, 2, 7, 16)" in cost.asked[0]
        assert result.counts == {"grouped_attention": fired}


@torch.no_grad()
def test_dynamo_graphs_repeat_by_indexing() -> None:
    """Under ``torch.compile(backend="autoopt")`` the repeat is ``x[:, :, None, :, :]``
    (a getitem, not an unsqueeze): rewritten the same way."""
    torch._dynamo.reset()
    record = autoopt.CaptureRecord(inputs="test")
    compiled = torch.compile(Grouped(), backend=lambda gm, example: autoopt.autoopt_backend(
        gm, example, record=record, options={"pass_options": UNMEASURED}))
    args = inputs()
    torch.testing.assert_close(compiled(*args), Grouped()(*args), rtol=1e-5, atol=1e-5)
    (applied,) = [r for r in record.passes if r.name == "grouped_attention"]
    assert applied.status == "applied" and applied.counts == {"grouped_attention": 1}


@pytest.mark.parametrize("case", ["training", "unmeasured_cuda", "other_dim", "repeat_read",
                                  "keys_only"])
def test_left_as_it_is(case: str) -> None:
    """Training graphs, an unmeasured GPU graph, and repeats that are not repeat_kv's (another
    dimension, a repeat read elsewhere too, values not repeated alike) keep their form."""

    class Other(nn.Module):
        def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            if case == "other_dim":  # heads interleaved the other way: head h reads h % KV
                b, kv, s, d = k.shape
                k = k[:, None].expand(b, 3, kv, s, d).reshape(b, 3 * kv, s, d)
                v = v[:, None].expand(b, 3, kv, s, d).reshape(b, 3 * kv, s, d)
                return nn.functional.scaled_dot_product_attention(q, k, v)
            keys = repeat_kv(k, 3)
            values = repeat_kv(v, 3) if case != "keys_only" else v.repeat(1, 3, 1, 1)
            out = nn.functional.scaled_dot_product_attention(q, keys, values)
            return out + keys.sum() if case == "repeat_read" else out

    q, k, v, _ = inputs()
    model = Other() if case in ("other_dim", "repeat_read", "keys_only") else Grouped()
    context = PassContext(training=case == "training",
                          device=torch.device("cuda" if case == "unmeasured_cuda" else "cpu"))
    result = grouped_attention(export_graph(model, (q, k, v), {}), context)
    assert not result.modified and result.counts in ({}, {"grouped_attention": 0})
    assert not any(n.kwargs.get("enable_gqa") for n in _sdpa(result.graph_module))


@torch.no_grad()
def test_a_grouped_query_decoder_generates_eager_tokens() -> None:
    """A Llama-style decoder with four query heads over two key/value heads: optimized, its
    forward and its greedy tokens are eager's, with the pass applied to the decode graph."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=64)
    model = transformers.LlamaForCausalLM(config).eval()
    ids = torch.randint(0, 128, (2, 9))
    # Not measured: whether the grouped call pays at this toy size differs by machine.
    fast = autoopt.optimize(model, (ids,), backend="aten", pass_options=UNMEASURED)
    counts = {p.name: p.counts for c in fast.report.captures for p in c.passes}
    assert counts["grouped_attention"] == {"grouped_attention": 2}  # one per layer
    torch.testing.assert_close(fast(ids).logits, model(ids).logits, rtol=1e-5, atol=1e-5)
    kw = {"max_new_tokens": 8, "min_new_tokens": 8, "do_sample": False}
    assert torch.equal(fast.generate(ids, **kw), model.generate(ids, **kw))
