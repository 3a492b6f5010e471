"""Replace hand-written attention with ``scaled_dot_product_attention``.

    q ─┐
    k ─ transpose ─ matmul ─ ×scale ─ [+ mask] ─ softmax(-1) ─ matmul ─ y
    v ─────────────────────────────────────────────────────────┘
                          ⟶      q, k, v, mask ─ sdpa(scale=scale) ─ y

One fused kernel instead of five ops and an L×S score matrix written to memory and read back
(PyTorch's CPU flash kernel, cuDNN/flash kernels on a GPU). Matches the form transformers'
"eager" attention and most hand-written modules take once ``remove_noops`` has dropped the
eval dropout and same-dtype casts between softmax and the second matmul.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch.fx import GraphModule, Node

from . import ops
from .base import PassContext, PassResult
from .graph import call_kwargs, is_call, match_path, meta_val

aten = torch.ops.aten


@dataclass(frozen=True)
class _Attention:
    q: Node
    k: Node
    v: Node
    mask: Node | None
    scale: float
    chain: tuple[Node, ...]  # the nodes the fused op replaces, output last


def replace_attention(gm: GraphModule, ctx: PassContext) -> PassResult:
    """Rewrite each matched attention into one ``scaled_dot_product_attention`` call: the ATen
    overload in an export graph, ``F.scaled_dot_product_attention`` in a Dynamo or
    ``symbolic_trace`` graph (where the pattern may be written with ``@``, ``torch.matmul``,
    ``x.transpose``, ``F.softmax``, ``x.softmax`` or an ``nn.Softmax`` module).

    Args:
        gm: the graph module, rewritten in place.
        ctx: ``training``: the graph is differentiated (then the fused call is
            ``attention_differentiable_twice``). The fused kernel is exact up to float
            reassociation, and the driver's verification checks it.
    """
    count = 0
    for node in list(gm.graph.nodes):
        match = _match(node)
        if match is None or not _safe(match):
            continue
        # The graph's own level: an export graph calls ATen overloads only. A graph that is
        # differentiated may be differentiated twice (a gradient penalty), which the fused
        # kernels' backward is not.
        sdpa = (attention_differentiable_twice if ctx.training
                else aten.scaled_dot_product_attention.default
                if isinstance(node.target, torch._ops.OpOverload)
                else F.scaled_dot_product_attention)
        with gm.graph.inserting_before(node):
            fused = gm.graph.call_function(
                sdpa, (match.q, match.k, match.v),
                {"attn_mask": match.mask, "dropout_p": 0.0, "is_causal": False,
                 "scale": match.scale})
        fused.meta.update(node.meta)
        node.replace_all_uses_with(fused)
        for dead in reversed(match.chain):
            if not dead.users:
                gm.graph.erase_node(dead)
        count += 1
    if count:
        gm.recompile()
    return PassResult(gm, count > 0, {"attention": count} if count else {})


def attention_differentiable_twice(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                   attn_mask: torch.Tensor | None = None,
                                   dropout_p: float = 0.0, is_causal: bool = False,
                                   scale: float | None = None) -> torch.Tensor:
    """``scaled_dot_product_attention`` (no dropout, not causal) whose backward can itself be
    differentiated (``create_graph=True``: gradient penalties, Hessian-vector products), as the
    hand-written attention it replaces could: the fused kernels' backward has no derivative
    (``derivative for aten::_scaled_dot_product_flash_attention_for_cpu_backward is not
    implemented``). A plain backward is the fused kernel's own."""
    assert dropout_p == 0.0 and not is_causal  # what the pass matches
    tensors = (q, k, v, attn_mask)
    if not torch.is_grad_enabled() or not any(
            t is not None and t.requires_grad for t in tensors):
        return F.scaled_dot_product_attention(q, k, v, attn_mask, scale=scale)
    return _TwiceDifferentiable.apply(q, k, v, attn_mask, scale)


class _TwiceDifferentiable(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                mask: torch.Tensor | None, scale: float | None) -> torch.Tensor:
        # The fused kernel run on detached leaves with its own autograd record, which a
        # plain backward replays (no recompute); the inputs are kept for a backward that
        # must be differentiable.
        needs = ctx.needs_input_grad[:4]
        with torch.enable_grad():
            leaves = [t if t is None else t.detach().requires_grad_(n)
                      for t, n in zip((q, k, v, mask), needs, strict=True)]
            out = F.scaled_dot_product_attention(*leaves[:3], leaves[3], scale=scale)
        ctx.leaves, ctx.out, ctx.scale = leaves, out, scale
        ctx.save_for_backward(q, k, v, mask)
        return out.detach()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        needs = ctx.needs_input_grad[:4]
        if torch.is_grad_enabled():  # create_graph=True: the attention written out, as before
            q, k, v, mask = ctx.saved_tensors
            scores = q @ k.transpose(-2, -1) * (
                ctx.scale if ctx.scale is not None else q.shape[-1] ** -0.5)
            out = torch.softmax(scores if mask is None else scores + mask, dim=-1) @ v
            wrt = [t for t, n in zip((q, k, v, mask), needs, strict=True) if n]
            grads = iter(torch.autograd.grad(out, wrt, grad, create_graph=True,
                                             allow_unused=True))
        else:
            wrt = [t for t, n in zip(ctx.leaves, needs, strict=True) if n]
            # Kept: a second backward over the same graph (retain_graph=True) reads it again.
            grads = iter(torch.autograd.grad(ctx.out, wrt, grad, retain_graph=True,
                                             allow_unused=True))
        return (*(next(grads) if n else None for n in needs), None)


def _match(out: Node) -> _Attention | None:
    """Walk back from ``probs @ v`` to ``q @ k^T``; None if any link is not the pattern."""
    head = match_path(out, [ops.MATMUL, ops.SOFTMAX])
    operands = _operands(out)
    if head is None or operands is None or operands[0] is not head[1]:
        return None
    probs, v = head[1], operands[1]
    softmax = _softmax_args(probs)
    if softmax is None or not isinstance(v, Node):
        return None
    scores, dim, dtype = softmax
    if not isinstance(scores, Node) or dim not in (-1, _rank(scores) - 1):
        return None
    if dtype not in (None, _dtype(scores)):
        return None
    mask = None
    added = _operands(scores) if is_call(scores, ops.ADD) and not scores.kwargs else None
    if added is not None:
        a, b = added
        raw, mask = (a, b) if is_call(a, ops.MULTIPLY | ops.DIVIDE | ops.MATMUL) else (b, a)
        if not isinstance(mask, Node):
            return None
    else:
        raw = scores
    scale, product = _scaled(raw)
    factors = _operands(product) if is_call(product, ops.MATMUL) else None
    if factors is None:
        return None
    q, k_t = factors
    q_scale, q = _scaled(q) if is_call(q, ops.MULTIPLY) else (1.0, q)
    k = _untransposed(k_t)
    if k is None or q is None or not isinstance(q, Node):
        return None
    chain = tuple(n for n in (_q_scale_node(factors[0]), k_t, product, raw, scores, probs, out)
                  if isinstance(n, Node))
    return _Attention(q, k, v, mask, scale * q_scale, _dedupe(chain))


def _operands(node: Any) -> tuple[Any, Any] | None:
    """The two operands of a binary call at any level (``a @ b``, ``torch.matmul(a, b)``,
    ``a.matmul(b)``); None for any other argument list."""
    if not isinstance(node, Node):
        return None
    if len(node.args) == 2 and not node.kwargs:
        return node.args[0], node.args[1]
    kw = call_kwargs(node) or {}
    if set(kw) == {"input", "other"}:
        return kw["input"], kw["other"]
    return None


def _softmax_args(node: Node) -> tuple[Any, Any, Any] | None:
    """``(input, dim, dtype)`` of a softmax at any level; None where it computes something
    else: ``half_to_float`` (ATen's ``_softmax``) or a dim left for PyTorch to guess."""
    if node.op == "call_module":  # nn.Softmax(dim)
        return (node.args[0], node.graph.owning_module.get_submodule(str(node.target)).dim,
                None) if len(node.args) == 1 and not node.kwargs else None
    kw = call_kwargs(node)
    if kw is None or kw.get("half_to_float"):
        return None
    return kw.get("input", kw.get("self")), kw.get("dim"), kw.get("dtype")


def _q_scale_node(q: Any) -> Node | None:
    """The ``q * c`` node feeding the first matmul, when the scale is applied to the query."""
    return q if is_call(q, ops.MULTIPLY) else None


def _scaled(node: Any) -> tuple[float, Node | None]:
    """``x * c``, ``c * x`` or ``x / c`` with a Python number ``c`` → (scale, x); else (1, x).
    Keyword arguments (``rounding_mode``) change what a division computes: no match."""
    if is_call(node, ops.MULTIPLY) and len(node.args) == 2 and not node.kwargs:
        a, b = node.args
        if _number(b) and isinstance(a, Node):
            return float(b), a
        if _number(a) and isinstance(b, Node):
            return float(a), b
        return 1.0, None
    if is_call(node, ops.DIVIDE) and len(node.args) == 2 and not node.kwargs:
        a, b = node.args
        if _number(b) and b != 0 and isinstance(a, Node):
            return 1.0 / float(b), a
        return 1.0, None
    return 1.0, node if isinstance(node, Node) else None


def _untransposed(k_t: Any) -> Node | None:
    """``k`` when ``k_t`` swaps k's last two dimensions."""
    if not is_call(k_t, ops.TRANSPOSE):
        return None
    kw = call_kwargs(k_t) or {}
    k, d0, d1 = kw.get("input", kw.get("self")), kw.get("dim0"), kw.get("dim1")
    rank = _rank(k)
    if not isinstance(k, Node) or rank < 2 or not (isinstance(d0, int) and isinstance(d1, int)):
        return None
    return k if {d0 % rank, d1 % rank} == {rank - 2, rank - 1} else None


def _safe(m: _Attention) -> bool:
    """Only rewrite what SDPA computes the same way: equal batch dims (no broadcasting between
    q, k and v), matching head sizes, one floating dtype, a float mask that broadcasts to the
    scores, and intermediate results nobody else reads (attention weights returned to the
    caller must still exist)."""
    q, k, v = meta_val(m.q), meta_val(m.k), meta_val(m.v)
    if not all(isinstance(t, torch.Tensor) for t in (q, k, v)):
        return False
    if not (q.dim() == k.dim() == v.dim() and q.dim() in (3, 4)):
        return False
    if not (q.dtype == k.dtype == v.dtype and q.dtype.is_floating_point):
        return False
    if not (q.shape[:-2] == k.shape[:-2] == v.shape[:-2] and q.shape[-1] == k.shape[-1]
            and k.shape[-2] == v.shape[-2]):
        return False
    if m.mask is not None:
        mask = meta_val(m.mask)
        scores = meta_val(m.chain[-3])  # softmax's input
        if not isinstance(mask, torch.Tensor) or mask.dtype != q.dtype:
            return False
        try:
            if torch.broadcast_shapes(mask.shape, scores.shape) != scores.shape:
                return False
        except RuntimeError:
            return False
    return all(len(n.users) == 1 for n in m.chain[:-1])


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _rank(node: Any) -> int:
    val = meta_val(node)
    return val.dim() if isinstance(val, torch.Tensor) else -1


def _dtype(node: Any) -> torch.dtype | None:
    val = meta_val(node)
    return val.dtype if isinstance(val, torch.Tensor) else None


def _dedupe(nodes: tuple[Node, ...]) -> tuple[Node, ...]:
    seen: list[Node] = []
    for n in nodes:
        if n not in seen:
            seen.append(n)
    return tuple(seen)
