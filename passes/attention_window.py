"""Attention over the filled part of a static KV cache, not over the whole of it.

    q, k_cache, v_cache, mask ─ sdpa ─ y   ⟶   q, k_cache, v_cache, mask ─ windowed_sdpa ─ y

A static cache (``generate``'s, or any preallocated one) is as long as the longest sequence
it may hold, and every decode step attends over all of it, the positions not yet written
masked out: a step early in a 256-position cache pays for 256 keys to use 40. Where the
queries are fewer than the keys (a cache: decode steps, a prompt into a longer cache) and a
mask is given, the attention call becomes ``windowed_sdpa``, which reads the mask at each call,
finds the last position any query may see, and attends over the keys up to there (rounded up
to a multiple of 64) with the same mask cut alike. The positions left out are ones every query
has masked, which contribute exactly zero (the results measured bitwise equal). The call is
the whole attention where a float mask leaves some query row no position at all (softmax then
spreads it over every masked key) or masks with another value than ``-inf`` or the dtype's
minimum.

Measured on an AMD EPYC, 1 thread: GPT-2-shaped decode attention at batch 8 (12 heads of 64)
over a 256-position cache with 64 positions filled, 248 → 96 µs per layer (the same results,
bitwise); reading the mask costs about 10 µs where nothing can be cut.

CPU only: on a GPU the decode step replays as a CUDA graph, which cannot hold a length chosen
at run time. A lowering (``autoopt.passes.LOWERING``): exports take the graph before it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensor
from torch.fx import GraphModule

from . import ops
from .base import PassContext, PassResult
from .graph import call_kwargs, is_call, meta_val

_STEP = 64  # windows are multiples of this many positions (fewer distinct kernel shapes)
_LONGEST_GAIN = 2 * _STEP  # caches shorter than this have no window worth cutting


def windowed_sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  attn_mask: torch.Tensor, scale: float | None = None,
                  enable_gqa: bool = False) -> torch.Tensor:
    """``scaled_dot_product_attention`` over the keys up to the last position ``attn_mask``
    lets any query see (rounded up to a multiple of 64): the same result."""
    length = key.shape[-2]
    window = length
    if not isinstance(query, FakeTensor) and query.device.type != "meta":
        window = _window(attn_mask, length)
    if window < length:
        key, value = key[..., :window, :], value[..., :window, :]
        attn_mask = attn_mask[..., :window]
    return F.scaled_dot_product_attention(query, key, value, attn_mask, scale=scale,
                                          enable_gqa=enable_gqa)


def _window(mask: torch.Tensor, length: int) -> int:
    if mask.shape[-1] != length:
        return length  # a mask broadcast along the keys: every position counts
    if mask.dtype == torch.bool:
        # A query that sees nothing gets the same from any number of masked keys.
        rows = mask.reshape(-1, length)
    elif mask.is_floating_point():
        rows = (mask > torch.finfo(mask.dtype).min).reshape(-1, length)
        if not bool(rows.any(-1).all()):
            return length  # a query that sees nothing: softmax spreads it over every key
    else:
        return length
    seen = rows.any(0).nonzero()
    last = int(seen.max()) + 1 if len(seen) else length
    return min(length, -(-last // _STEP) * _STEP)


def attention_window(gm: GraphModule, ctx: PassContext) -> PassResult:
    if ctx.training or ctx.device.type != "cpu":
        return PassResult(gm, False)
    rewritten = 0
    for node in list(gm.graph.nodes):
        if not is_call(node, ops.ATTENTION):
            continue
        kwargs = call_kwargs(node)
        if kwargs is None or kwargs.get("dropout_p", 0.0) or kwargs.get("is_causal"):
            continue
        q, k, mask = (meta_val(kwargs.get(name)) for name in ("query", "key", "attn_mask"))
        if not all(isinstance(t, torch.Tensor) for t in (q, k, mask)):
            continue
        lengths = (q.shape[-2], k.shape[-2], mask.shape[-1])
        if not all(isinstance(n, int) for n in lengths):
            continue  # a symbolic length: the prompt graph of any prompt
        queries, keys, masked = lengths
        if not (queries < keys and keys >= _LONGEST_GAIN and masked == keys):
            continue
        node.target = windowed_sdpa
        node.args = (kwargs["query"], kwargs["key"], kwargs["value"], kwargs["attn_mask"])
        node.kwargs = {"scale": kwargs.get("scale"),
                       "enable_gqa": bool(kwargs.get("enable_gqa", False))}
        rewritten += 1
    if rewritten:
        gm.recompile()
    return PassResult(gm, bool(rewritten), {"attention_window": rewritten})
