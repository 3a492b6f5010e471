"""Grouped-query attention on the shared keys and values, not on copies repeated per head.

    k ─ unsqueeze(2) ─ expand(B, KV, R, S, D) ─ reshape(B, KV·R, S, D) ─┐
    v ─ unsqueeze(2) ─ expand(B, KV, R, S, D) ─ reshape(B, KV·R, S, D) ─ sdpa(q, ·, ·) ─ y
                          ⟶      q, k, v ─ sdpa(q, k, v, enable_gqa=True) ─ y

transformers' ``repeat_kv`` (Llama, Mistral, Qwen and the other grouped-query decoders) copies
each key/value head once per query head that reads it before attention: at every decode step
the whole cache, R times over, written and read back. ``enable_gqa`` computes the same function
(query head h reads key/value head h // R, exactly the repeat's order) on the shared heads;
PyTorch's CPU flash kernel then reads each key/value block once for its R query heads.
Measured on an AMD EPYC, 1 thread: a decode step's attention at batch 8, 12 query heads over 4
key/value heads, a 256-position cache, 445 → 201 µs per layer (the repeat's copies were half
of it).

Where the choice is measured (a cost model and static shapes) each distinct shape keeps the
faster form: on CUDA the memory-efficient kernel has no grouped form, and a masked grouped
call there falls back to the math kernel. Without a measurement only CPU graphs are rewritten,
where it was measured faster. It is a lowering (``autoopt.passes.LOWERING``): an ONNX export
takes the graph before it, whose opset spells attention without ``enable_gqa``.
"""

from __future__ import annotations

import logging
import operator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch.fx import GraphModule, Node

from . import ops
from .base import PassContext, PassResult
from .graph import call_kwargs, is_call, meta_val

log = logging.getLogger(__name__)

aten = torch.ops.aten

_UNSQUEEZE = ops.OpSet(frozenset({aten.unsqueeze.default, torch.unsqueeze}),
                       frozenset({"unsqueeze"}))


@dataclass(frozen=True)
class _Repeat:
    source: Node  # the (B, KV, S, D) keys or values before the repeat
    groups: int  # R: query heads per key/value head


def grouped_attention(gm: GraphModule, ctx: PassContext) -> PassResult:
    if ctx.training:
        return PassResult(gm, False)  # gradients through the grouped kernel are not verified
    rewritten = 0
    for node in list(gm.graph.nodes):
        if not is_call(node, ops.ATTENTION):
            continue
        kwargs = call_kwargs(node)
        if kwargs is None or kwargs.get("enable_gqa") or kwargs.get("dropout_p", 0.0):
            continue
        key, value = _repeat(kwargs.get("key")), _repeat(kwargs.get("value"))
        if key is None or value is None or key.groups != value.groups:
            continue
        if not _pays(ctx, kwargs, key, value):
            continue
        node.args = (kwargs["query"], key.source, value.source, kwargs.get("attn_mask"),
                     kwargs.get("dropout_p", 0.0), kwargs.get("is_causal", False))
        node.kwargs = {**({"scale": kwargs["scale"]} if kwargs.get("scale") is not None
                          else {}), "enable_gqa": True}
        for repeat in dict.fromkeys((kwargs["key"], kwargs["value"])):  # reshape, expand, …
            while repeat is not key.source and repeat is not value.source \
                    and not repeat.users:
                before = repeat.args[0]
                gm.graph.erase_node(repeat)
                repeat = before
        rewritten += 1
    if rewritten:
        gm.recompile()
    return PassResult(gm, bool(rewritten), {"grouped_attention": rewritten})


def _repeat(node: Any) -> _Repeat | None:
    """The keys or values ``node`` repeats per query head (``repeat_kv``), or None."""
    if not (is_call(node, ops.RESHAPE) and len(node.users) == 1):
        return None
    expand = node.args[0]
    if not (is_call(expand, ops.EXPAND) and len(expand.users) == 1):
        return None
    unsqueeze = expand.args[0]
    if not (_new_axis_2(unsqueeze) and len(unsqueeze.users) == 1):
        return None
    source = unsqueeze.args[0]
    inner, repeated, out = meta_val(source), meta_val(expand), meta_val(node)
    if not all(isinstance(t, torch.Tensor) for t in (inner, repeated, out)) or \
            inner.dim() != 4:
        return None
    b, kv, s, d = inner.shape
    groups = repeated.shape[2]
    if (tuple(repeated.shape) != (b, kv, groups, s, d)
            or tuple(out.shape) != (b, kv * groups, s, d)):
        return None
    return _Repeat(source, groups)


def _new_axis_2(node: Any) -> bool:
    """Whether ``node`` inserts a size-1 axis at position 2 of a 4-D tensor: ``unsqueeze(x, 2)``
    (export graphs) or ``x[:, :, None]`` / ``x[:, :, None, :, :]`` (Dynamo graphs)."""
    if is_call(node, _UNSQUEEZE):
        dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
        return dim in (2, -3)
    if not (isinstance(node, Node) and node.op == "call_function"
            and node.target is operator.getitem and len(node.args) == 2):
        return False
    index, whole = node.args[1], slice(None)
    return (isinstance(index, tuple) and len(index) in (3, 5) and index[2] is None
            and all(part == whole for i, part in enumerate(index) if i != 2))


def _pays(ctx: PassContext, kwargs: dict[str, Any], key: _Repeat, value: _Repeat) -> bool:
    """Whether the grouped call measures at least as fast as the repeated one on random inputs
    of the real shapes; without a measurement, whether the graph runs on the CPU."""
    q, k, v = (meta_val(n) for n in (kwargs["query"], key.source, value.source))
    mask = meta_val(kwargs.get("attn_mask"))
    shapes = [t.shape for t in (q, k, v, mask) if isinstance(t, torch.Tensor)]
    static = all(isinstance(size, int) for shape in shapes for size in shape)
    if ctx.cost is None or not static or not bool(ctx.options.get("measure", True)):
        return ctx.device.type == "cpu"
    device = ctx.device
    q, k, v = (torch.randn(t.shape, dtype=t.dtype, device=device) for t in (q, k, v))
    if isinstance(mask, torch.Tensor):
        mask = (torch.ones(mask.shape, dtype=torch.bool, device=device)
                if mask.dtype == torch.bool else
                torch.zeros(mask.shape, dtype=mask.dtype, device=device))
    else:
        mask = None
    rest = {"is_causal": bool(kwargs.get("is_causal", False)), "scale": kwargs.get("scale")}
    groups = key.groups

    def repeated() -> torch.Tensor:
        b, kv, s, d = k.shape
        expand = (b, kv, groups, s, d)
        return F.scaled_dot_product_attention(
            q, k[:, :, None].expand(expand).reshape(b, kv * groups, s, d),
            v[:, :, None].expand(expand).reshape(b, kv * groups, s, d), mask, **rest)

    what = (f"grouped_attention|q{tuple(q.shape)}|kv{tuple(k.shape)}|"
            f"mask{tuple(mask.shape) if mask is not None else None}:"
            f"{mask.dtype if mask is not None else None}|{q.dtype}|causal={rest['is_causal']}")
    best, seconds = ctx.cost.fastest(what, {
        "grouped": lambda: F.scaled_dot_product_attention(q, k, v, mask, enable_gqa=True,
                                                          **rest),
        "repeated": repeated})
    log.debug("%s: %s", what, seconds)
    return best == "grouped"
