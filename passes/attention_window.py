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
bitwise); reading the mask costs about 10 µs where nothing can be cut. Every layer of a step
passes the same mask, so it is read once a step (the window is kept for that mask object). A
cache shorter than 256 positions is left whole: there cutting and reading cost more than the
keys saved (batch 1, 128 positions: 35 against 27 µs).

A bf16 or fp16 attention of a few queries over more keys (a decode step) is computed in fp32
and its result rounded back: ATen's CPU flash kernel runs such a call 2.5-4x slower in bf16
than in fp32 on an AMD EPYC without AMX (a Llama-style step, 12 heads over 4 KV heads, 128
positions: 167 against 27 µs, casts included 68), and fp32 holds the scores and softmax more
closely.

Where autoopt's own kernels are built (``block_kernels``), a decode step's attention (at most
8 queries, fp32 or bf16) has a third form, ``autoopt_blocks.decode_attention``
(``decode_attention.cpp``): it never reads a key the mask hides from every query (no window to
find first), reads each key head once for the query heads that share it, and is one op call
where ``windowed_sdpa`` is a Python call around ATen's. The cost model measures it against
``windowed_sdpa`` per shape (the mask half filled, as mid-way through a cache) and keeps the
faster: on an Intel Xeon, 1 thread, a Llama-style step's layer (12 heads over 4, 64 wide, 97
of 256 positions) took 33 against 51 us, and in bf16 28 against 169 us. Its sums run in
another order than ATen's: the same within fp32 rounding, not bitwise.

CPU only: on a GPU the decode step replays as a CUDA graph, which cannot hold a length chosen
at run time. A lowering (``autoopt.passes.LOWERING``): exports take the graph before it.
"""

from __future__ import annotations

import math
import weakref
from typing import Any

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensor
from torch.fx import GraphModule

from . import block_kernels, ops
from .base import PassContext, PassResult
from .graph import call_kwargs, is_call, meta_val

_STEP = 64  # windows are multiples of this many positions (fewer distinct kernel shapes)
_LONGEST_GAIN = 4 * _STEP  # caches shorter than this have no window worth cutting
_FEW_QUERIES = 8  # low-precision attention of at most this many queries runs in fp32
_LOW = (torch.bfloat16, torch.float16)
# The last mask read and its window: (the mask, its version, the cache length, the window).
_LAST: tuple[weakref.ref[torch.Tensor], int, int, int] | None = None


def windowed_sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  attn_mask: torch.Tensor | None, scale: float | None = None,
                  enable_gqa: bool = False) -> torch.Tensor:
    """``scaled_dot_product_attention`` over the keys up to the last position ``attn_mask``
    lets any query see (rounded up to a multiple of 64), in fp32 where a few queries are in
    bf16 or fp16."""
    length = key.shape[-2]
    real = not isinstance(query, FakeTensor) and query.device.type != "meta"
    if real and attn_mask is not None and length >= _LONGEST_GAIN:
        window = _window_of(attn_mask, length)
        if window < length:
            key, value = key[..., :window, :], value[..., :window, :]
            attn_mask = attn_mask[..., :window]
    if not (real and query.dtype in _LOW and query.shape[-2] <= _FEW_QUERIES):
        return F.scaled_dot_product_attention(query, key, value, attn_mask, scale=scale,
                                              enable_gqa=enable_gqa)
    mask = attn_mask if attn_mask is None or attn_mask.dtype == torch.bool \
        else attn_mask.float()
    return F.scaled_dot_product_attention(query.float(), key.float(), value.float(), mask,
                                          scale=scale, enable_gqa=enable_gqa).to(query.dtype)


def _window_of(mask: torch.Tensor, length: int) -> int:
    """``_window``, read once for the mask every layer of a step passes."""
    global _LAST
    last = _LAST
    if last is not None and last[0]() is mask and last[1] == mask._version \
            and last[2] == length:
        return last[3]
    window = _window(mask, length)
    _LAST = (weakref.ref(mask), mask._version, length, window)
    return window


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
    rewritten = kernels = 0
    for node in list(gm.graph.nodes):
        if not is_call(node, ops.ATTENTION):
            continue
        kwargs = call_kwargs(node)
        if kwargs is None or kwargs.get("dropout_p", 0.0) or kwargs.get("is_causal"):
            continue
        q, k, mask = (meta_val(kwargs.get(name)) for name in ("query", "key", "attn_mask"))
        if not all(isinstance(t, torch.Tensor) for t in (q, k)) or not (
                mask is None or isinstance(mask, torch.Tensor)):
            continue
        queries, keys = q.shape[-2], k.shape[-2]
        if not all(isinstance(n, int) for n in (queries, keys)):
            continue  # a symbolic length: the prompt graph of any prompt
        window = (mask is not None and queries < keys and keys >= _LONGEST_GAIN
                  and mask.shape[-1] == keys)
        few = queries <= _FEW_QUERIES and queries < keys
        if not (window or few):
            continue
        v = meta_val(kwargs.get("value"))
        scale = kwargs.get("scale")
        if few and _kernel_serves(q, k, v, mask, kwargs) and \
                _kernel_pays(ctx, q, k, v, mask, scale):
            node.target = torch.ops.autoopt_blocks.decode_attention.default
            node.args = (kwargs["query"], kwargs["key"], kwargs["value"], kwargs.get("attn_mask"),
                         _scale(q, scale))
            node.kwargs = {}
            rewritten += 1
            kernels += 1
            continue
        if not (window or q.dtype in _LOW):
            continue
        node.target = windowed_sdpa
        node.args = (kwargs["query"], kwargs["key"], kwargs["value"], kwargs.get("attn_mask"))
        node.kwargs = {"scale": kwargs.get("scale"),
                       "enable_gqa": bool(kwargs.get("enable_gqa", False))}
        rewritten += 1
    if rewritten:
        gm.recompile()
    counts = {"attention_window": rewritten - kernels, "decode_attention": kernels}
    return PassResult(gm, bool(rewritten), {k: v for k, v in counts.items() if v})


def _scale(q: torch.Tensor, scale: float | None) -> float:
    """The scale the attention call applies: its own, else ATen's default."""
    return float(scale if scale is not None else 1.0 / math.sqrt(q.shape[-1]))


def _kernel_serves(q: torch.Tensor, k: torch.Tensor, v: Any, mask: torch.Tensor | None,
                   kwargs: dict[str, Any]) -> bool:
    """Whether ``decode_attention`` computes this call: a few queries of fp32 or bf16, key
    and value of one shape, query heads a multiple of the key heads (grouped only where the
    call says so), a bool or float mask."""
    if not (isinstance(v, torch.Tensor) and q.dim() == k.dim() == v.dim() == 4
            and q.dtype in (torch.float32, torch.bfloat16) and k.dtype == v.dtype == q.dtype
            and q.shape[-2] <= _FEW_QUERIES and k.shape == v.shape
            and q.shape[0] == k.shape[0] and q.shape[-1] == k.shape[-1]
            and all(isinstance(n, int) for n in (*q.shape, *k.shape))):
        return False
    heads, key_heads = q.shape[1], k.shape[1]
    if heads != key_heads and not (kwargs.get("enable_gqa") and heads % key_heads == 0):
        return False
    if mask is not None and not (mask.dtype == torch.bool or mask.is_floating_point()):
        return False
    return block_kernels.unavailable() is None


def _kernel_pays(ctx: PassContext, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 mask: torch.Tensor | None, scale: float | None) -> bool:
    """Whether ``decode_attention`` measures faster than ``windowed_sdpa`` on these shapes,
    the mask letting every query see the first half of the keys (a step mid-way through a
    cache). Without a cost model: not taken. The pass option ``kernel`` (``"decode_attention"``
    or ``"windowed_sdpa"``) names the form instead of measuring."""
    named = ctx.options.get("kernel")
    if named is not None:
        if named not in ("decode_attention", "windowed_sdpa"):
            raise ValueError(f"attention_window: kernel={named!r}: name 'decode_attention' or "
                             f"'windowed_sdpa'")
        return named == "decode_attention"
    if ctx.cost is None:
        return False
    q, k, v = (torch.randn(t.shape, dtype=t.dtype) for t in (q, k, v))
    length = k.shape[-2]
    if mask is not None:
        seen = torch.arange(length) < max(1, length // 2)
        mask = (seen if mask.dtype == torch.bool else
                torch.where(seen, 0.0, float("-inf")).to(mask.dtype)).expand(mask.shape)
        mask = mask.contiguous()
    gqa = q.shape[1] != k.shape[1]
    value = _scale(q, scale)
    what = (f"decode_attention|q{tuple(q.shape)}|kv{tuple(k.shape)}|"
            f"mask{tuple(mask.shape) if mask is not None else None}:"
            f"{mask.dtype if mask is not None else None}|{q.dtype}")
    best, _ = ctx.cost.fastest(what, {
        "windowed_sdpa": lambda: windowed_sdpa(q, k, v, mask, scale=scale, enable_gqa=gqa),
        "decode_attention": lambda: torch.ops.autoopt_blocks.decode_attention(q, k, v, mask,
                                                                              value)})
    return best == "decode_attention"
