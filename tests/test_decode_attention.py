"""autoopt's decode-attention kernel (``passes/decode_attention.cpp``): a few queries over a KV
cache. It equals ATen's attention within fp32 rounding for every mask, head grouping and layout
a decode step hands it; ``attention_window`` takes it where named or measured faster, and a
decoder generates eager's tokens on it. Skips where autoopt's kernels cannot be built."""

from __future__ import annotations

import math

import pytest
import torch
import transformers
from torch import nn

import autoopt
from autoopt.capture.graph import export_graph
from autoopt.passes import PassContext, attention_window, block_kernels

F = nn.functional
WHY = block_kernels.unavailable()
pytestmark = pytest.mark.skipif(WHY is not None, reason=f"the block kernels need {WHY}")


def _kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
            scale: float | None = None) -> torch.Tensor:
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    return torch.ops.autoopt_blocks.decode_attention(q, k, v, mask, scale)


def _aten(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
          scale: float | None = None) -> torch.Tensor:
    return F.scaled_dot_product_attention(q.float(), k.float(), v.float(), mask, scale=scale,
                                          enable_gqa=q.shape[1] != k.shape[1])


def _filled(b: int, queries: int, length: int, filled: int) -> torch.Tensor:
    mask = torch.zeros(b, 1, queries, length, dtype=torch.bool)
    mask[..., :filled] = True
    return mask


@pytest.mark.parametrize(("b", "heads", "key_heads", "queries", "width", "length", "filled"), [
    (1, 12, 4, 1, 64, 256, 97),    # a Llama-style step: grouped heads
    (2, 4, 4, 1, 16, 256, 1),      # GPT-2-style, one position filled
    (1, 8, 2, 3, 48, 70, 70),      # a few queries, a width that is not 16 lanes
    (3, 6, 3, 2, 40, 33, 20),
])
def test_it_equals_atens_attention(b: int, heads: int, key_heads: int, queries: int,
                                   width: int, length: int, filled: int) -> None:
    torch.manual_seed(0)
    q = torch.randn(b, heads, queries, width)
    k, v = torch.randn(b, key_heads, length, width), torch.randn(b, key_heads, length, width)
    mask = _filled(b, queries, length, filled)
    floats = torch.zeros(mask.shape).masked_fill(~mask, float("-inf"))
    for m in (mask, floats, None):
        torch.testing.assert_close(_kernel(q, k, v, m), _aten(q, k, v, m),
                                   rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(_kernel(q, k, v, mask, 0.3), _aten(q, k, v, mask, 0.3),
                               rtol=1e-5, atol=1e-6)


def test_masks_per_row_padding_and_rows_that_see_nothing() -> None:
    """A padded batch (each row its own positions), a mask per head, and a query whose mask
    hides everything (zeros, as ATen's kernel gives) or leaves it only the dtype's minimum
    (softmax spreads it over every key)."""
    torch.manual_seed(1)
    q, k, v = torch.randn(3, 4, 2, 32), torch.randn(3, 2, 50, 32), torch.randn(3, 2, 50, 32)
    mask = torch.rand(3, 4, 2, 50) > 0.5
    mask[1, 2, 0] = False
    torch.testing.assert_close(_kernel(q, k, v, mask), _aten(q, k, v, mask),
                               rtol=1e-5, atol=1e-6)
    assert torch.equal(_kernel(q, k, v, mask)[1, 2, 0], torch.zeros(32))
    floats = torch.zeros(mask.shape).masked_fill(~mask, torch.finfo(torch.float32).min)
    torch.testing.assert_close(_kernel(q, k, v, floats), _aten(q, k, v, floats),
                               rtol=1e-5, atol=1e-6)


def test_layouts_dtypes_and_thread_counts() -> None:
    """Keys and values as a cache's views hand them (a transposed copy, a slice); bf16,
    computed in fp32 and rounded once; the same bits at 1 and 2 threads (each head is one
    thread's)."""
    torch.manual_seed(2)
    q = torch.randn(2, 8, 1, 32)
    k = torch.randn(2, 60, 8, 32).transpose(1, 2)  # (b, heads, length, width), strided
    v = torch.randn(2, 8, 64, 32)[:, :, :60]
    mask = _filled(2, 1, 60, 45)
    torch.testing.assert_close(_kernel(q, k, v, mask), _aten(q, k, v, mask),
                               rtol=1e-5, atol=1e-6)
    low = [t.bfloat16() for t in (q, k, v)]
    got = _kernel(*low, mask)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), _aten(*low, mask), rtol=2**-8, atol=1e-6)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = _kernel(q, k, v, mask)
        torch.set_num_threads(2)
        assert torch.equal(_kernel(q, k, v, mask), one)
    finally:
        torch.set_num_threads(threads)


def test_shapes_it_cannot_take_are_refused() -> None:
    q, k = torch.randn(1, 5, 1, 16), torch.randn(1, 2, 8, 16)
    with pytest.raises(RuntimeError, match="multiple of KV"):
        _kernel(q, k, k, None)
    with pytest.raises(RuntimeError, match="fp32 or bf16"):
        _kernel(q.double(), k.double()[:, :1], k.double()[:, :1], None)


class _Step(nn.Module):
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                mask: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, mask, enable_gqa=True)


@pytest.mark.parametrize("kernel", ["decode_attention", "windowed_sdpa"])
def test_the_pass_takes_the_form_named(kernel: str) -> None:
    torch.manual_seed(3)
    inputs = (torch.randn(1, 6, 1, 16), torch.randn(1, 2, 256, 16), torch.randn(1, 2, 256, 16),
              _filled(1, 1, 256, 30))
    gm = export_graph(_Step(), inputs, {})
    result = attention_window(gm, PassContext(options={"kernel": kernel}))
    assert result.counts == {"attention_window" if kernel == "windowed_sdpa" else kernel: 1}
    targets = {str(n.target) for n in result.graph_module.graph.nodes}
    assert any("decode_attention" in t for t in targets) == (kernel == "decode_attention")
    torch.testing.assert_close(result.graph_module(*inputs), _Step()(*inputs),
                               rtol=1e-5, atol=1e-6)


def test_without_a_cost_model_or_with_a_wrong_name() -> None:
    inputs = (torch.randn(1, 6, 1, 16), torch.randn(1, 2, 256, 16), torch.randn(1, 2, 256, 16),
              _filled(1, 1, 256, 30))
    result = attention_window(export_graph(_Step(), inputs, {}), PassContext())
    assert result.counts == {"attention_window": 1}  # nothing measured: not taken
    with pytest.raises(ValueError, match="decode_attention"):
        attention_window(export_graph(_Step(), inputs, {}),
                         PassContext(options={"kernel": "flash"}))


@torch.no_grad()
def test_a_decoder_generates_eagers_tokens_on_it() -> None:
    """A Llama-style decoder (grouped heads) through the default backends, the kernel named:
    greedy tokens are eager's, and the decode graph runs it in each layer."""
    torch.manual_seed(4)
    config = transformers.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=512)
    model = transformers.LlamaForCausalLM(config).eval()
    ids = torch.randint(1, 96, (2, 6))
    fast = autoopt.optimize(model, (ids,),
                            pass_options={"attention_window": {"kernel": "decode_attention"}})
    kw = {"max_new_tokens": 10, "min_new_tokens": 10, "do_sample": False}
    assert torch.equal(fast.generate(ids, **kw), model.generate(ids, **kw))
    counts = [p.counts for r in fast._generator.reports for c in r.captures for p in c.passes
              if p.name == "attention_window"]
    assert {"decode_attention": 2} in counts
