"""attention_window: attention over a static cache's filled positions only, the window read
from the mask at each call."""

from __future__ import annotations

import importlib

import pytest
import torch
import transformers
from torch import nn

import autoopt
from autoopt.capture.graph import export_graph
from autoopt.passes import PassContext, attention_window
from autoopt.passes.attention_window import _window, windowed_sdpa

F = nn.functional
MIN = torch.finfo(torch.float32).min
# The module (the package's name of the same spelling is the pass function).
window_module = importlib.import_module("autoopt.passes.attention_window")


def cache(b: int = 2, h: int = 3, queries: int = 1, length: int = 256, d: int = 16,
          filled: int = 40) -> tuple[torch.Tensor, ...]:
    """A decode step's q and a cache of ``length`` positions, the first ``filled`` of which
    each query may see (bool mask)."""
    q = torch.randn(b, h, queries, d)
    k, v = torch.randn(b, h, length, d), torch.randn(b, h, length, d)
    mask = torch.zeros(b, 1, queries, length, dtype=torch.bool)
    mask[..., :filled] = True
    return q, k, v, mask


@pytest.mark.parametrize("filled, window", [(1, 64), (40, 64), (64, 64), (65, 128),
                                            (200, 256), (256, 256)])
def test_the_window_is_the_last_visible_position_rounded_up(filled: int, window: int) -> None:
    q, k, v, mask = cache(filled=filled)
    assert _window(mask, 256) == window
    floats = torch.zeros(mask.shape).masked_fill(~mask, MIN)
    assert _window(floats, 256) == window
    assert _window(floats.masked_fill(~mask, float("-inf")), 256) == window
    for m in (mask, floats):
        torch.testing.assert_close(windowed_sdpa(q, k, v, m), F.scaled_dot_product_attention(
            q, k, v, m))


def test_positions_one_row_sees_count_for_every_row() -> None:
    """The window is the furthest position any query (any batch row) sees: a padded batch."""
    q, k, v, mask = cache(b=3, filled=10)
    mask[1, ..., 150] = True
    assert _window(mask, 256) == 192
    torch.testing.assert_close(windowed_sdpa(q, k, v, mask),
                               F.scaled_dot_product_attention(q, k, v, mask))


def test_masks_it_cannot_read_keep_the_whole_cache() -> None:
    q, k, v, mask = cache(b=2, filled=10)
    floats = torch.zeros(mask.shape).masked_fill(~mask, MIN)
    floats[1] = MIN  # a query that sees nothing: softmax spreads it over all 256 keys
    assert _window(floats, 256) == 256
    torch.testing.assert_close(windowed_sdpa(q, k, v, floats),
                               F.scaled_dot_product_attention(q, k, v, floats))
    finite = torch.zeros(mask.shape).masked_fill(~mask, -1e4)  # another masked value
    assert _window(finite, 256) == 256
    assert _window(mask[..., :1], 256) == 256  # broadcast along the keys


class Step(nn.Module):
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                mask: torch.Tensor | None) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.5)


def test_attention_over_a_cache_becomes_windowed() -> None:
    args = cache()
    result = attention_window(export_graph(Step(), args, {}), PassContext())
    assert result.counts == {"attention_window": 1}
    (node,) = [n for n in result.graph_module.graph.nodes if n.target is windowed_sdpa]
    assert node.kwargs["scale"] == 0.5
    for filled in (3, 100, 256):  # one graph, the window chosen at each call
        fresh = cache(filled=filled)
        torch.testing.assert_close(result.graph_module(*fresh), Step()(*fresh))


@pytest.mark.parametrize("case", ["training", "cuda", "no_cache", "short_cache", "no_mask"])
def test_left_as_it_is(case: str) -> None:
    args = cache(queries=256 if case == "no_cache" else 1,
                 length=64 if case == "short_cache" else 256)
    if case == "no_mask":
        args = (*args[:3], None)
    context = PassContext(training=case == "training",
                          device=torch.device("cuda" if case == "cuda" else "cpu"))
    gm = export_graph(Step(), args, {})
    result = attention_window(gm, context)
    assert not result.modified
    assert not any(n.target is windowed_sdpa for n in result.graph_module.graph.nodes)


def test_the_mask_every_layer_passes_is_read_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """The layers of one step pass one mask object: its window is read once; a mask written
    in place, or another mask, is read again."""
    reads: list[int] = []
    monkeypatch.setattr(window_module, "_window",
                        lambda mask, length: reads.append(length) or _window(mask, length))
    q, k, v, mask = cache(filled=40)
    for _ in range(3):
        torch.testing.assert_close(windowed_sdpa(q, k, v, mask), F.scaled_dot_product_attention(
            q, k, v, mask))
    assert reads == [256]
    mask[..., 40:100] = True  # the next position written in place: a longer window
    torch.testing.assert_close(windowed_sdpa(q, k, v, mask),
                               F.scaled_dot_product_attention(q, k, v, mask))
    windowed_sdpa(q, k, v, mask.clone())
    assert reads == [256] * 3


@pytest.mark.parametrize("mask_kind", ["bool", "float", "none"])
def test_a_low_precision_decode_step_attends_in_fp32(mask_kind: str) -> None:
    """bf16 attention of one query over a short cache: rewritten, computed in fp32 on the
    bf16 inputs and rounded once; a prompt's many queries stay as they are."""
    q, k, v, mask = cache(length=64)
    q, k, v = q.bfloat16(), k.bfloat16(), v.bfloat16()
    mask = {"bool": mask, "none": None,
            "float": torch.zeros(mask.shape, dtype=torch.bfloat16).masked_fill(
                ~mask, torch.finfo(torch.bfloat16).min)}[mask_kind]
    result = attention_window(export_graph(Step(), (q, k, v, mask), {}), PassContext())
    assert result.counts == {"attention_window": 1}
    got = result.graph_module(q, k, v, mask)
    expected = F.scaled_dot_product_attention(
        q.float(), k.float(), v.float(), None if mask is None else
        mask if mask.dtype == torch.bool else mask.float(), scale=0.5)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), expected, rtol=2**-8, atol=1e-6)
    prompt = cache(queries=32, length=64)
    prompt = (*(t.bfloat16() for t in prompt[:3]), prompt[3])
    assert not attention_window(export_graph(Step(), prompt, {}), PassContext()).modified


@torch.no_grad()
def test_decoding_with_a_static_cache_gives_eager_tokens() -> None:
    """GPT-2 from a small config: the decode graph attends over its cache's filled positions
    (at most 64 of its 256 here) and the tokens are eager's."""
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=128, n_embd=64, n_layer=2, n_head=4,
                                     n_positions=512, bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(config).eval()
    ids = torch.randint(1, 128, (2, 7))
    fast = autoopt.optimize(model, (ids,), backend="aten")
    kw = {"max_new_tokens": 12, "min_new_tokens": 12, "do_sample": False}
    assert torch.equal(fast.generate(ids, **kw), model.generate(ids, **kw))
    windowed = [(p.status, p.counts) for r in fast._generator.reports for c in r.captures
                for p in c.passes if p.name == "attention_window"]
    # The decode step's graph, each layer's attention (windowed, or autoopt's decode kernel
    # where it measured faster); the prompt's has a symbolic length.
    assert any(status == "applied" and sum(counts.values()) == 2 for status, counts in windowed)


@torch.no_grad()
def test_the_hybrid_backend_calls_the_window_between_inductors_regions() -> None:
    """Under ``hybrid`` the windowed call is one of autoopt's kernels that Inductor's
    generated regions call out to; the tokens stay eager's."""
    pytest.importorskip("torch._inductor")
    torch.manual_seed(1)
    config = transformers.GPT2Config(vocab_size=96, n_embd=32, n_layer=2, n_head=2,
                                     n_positions=512, bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(config).eval()
    ids = torch.randint(1, 96, (1, 5))
    fast = autoopt.optimize(model, (ids,), backends=("hybrid", "aten"))
    kw = {"max_new_tokens": 6, "min_new_tokens": 6, "do_sample": False}
    assert torch.equal(fast.generate(ids, **kw), model.generate(ids, **kw))
    # The decode step's choice: hybrid built, verified against eager and measured (it was
    # not applicable before the window: no kernel of autoopt's in that graph).
    choices = [c for r in fast._generator.reports for c in r.backends]
    assert any("hybrid" in c.seconds and "hybrid" not in c.skipped for c in choices)
    assert all("windowed_sdpa ×2" in c.regions or "decode_attention ×2" in c.regions
               for c in choices if c.chosen == "hybrid")
