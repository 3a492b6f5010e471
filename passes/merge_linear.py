"""Sibling linear layers that read the same input into one wider matmul and a split.

    x ─┬─ linear(Wq, bq) ─ q              x ─ linear(W, b) ─ split ─┬─ q
       ├─ linear(Wk, bk) ─ k      ⟶                                ├─ k      W = [Wq; Wk; Wv]
       └─ linear(Wv, bv) ─ v                                       └─ v      b = [bq; bk; bv]

One GEMM with N = ΣNᵢ reads ``x`` once and keeps the matrix unit busier than several narrow
ones: it pays for small token counts (batch 1) and can cost at large ones, so the cost model
measures both forms for each group's shapes and keeps the faster. The outputs are views into
the wide result, as ``torch.split`` gives. A merged weight is a copy of the group's weights,
held until the lowerings: a group whose copy would exceed the memory optimize may still add
(``optimize_memory``, or what is free) stays separate, counted as ``kept_for_memory``.
"""

from __future__ import annotations

import functools
import logging
import operator
import weakref
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.fx import GraphModule, Node

from autoopt.cost_model import allowance as memory

from . import ops
from .base import PassContext, PassResult
from .graph import (
    add_constant,
    attr,
    call_kwargs,
    constant_tensor,
    copy_graph_module,
    fake_like,
    meta_val,
    size_hints,
)

log = logging.getLogger(__name__)

aten = torch.ops.aten

# The ``get_attr`` node meta key naming what a merged weight stacks: ``[(target, weakref)]``.
MERGED_FROM = "merged_from"
# The meta key of an ``aten.cat`` node the pass runner puts in place of a merged weight before the
# lowerings: the concatenation of constants that a lowering may pack
# (``autoopt.compile.pass_runner``).
CONCATENATED = "merged_weight"


def merge_linear(gm: GraphModule, ctx: PassContext) -> PassResult:
    """Merge each group of two or more linear ops on the same input, with constant weights of
    one dtype, into one linear and a split, where the cost model measures it faster.

    Not in training: the merged weight is a new constant, which gradients would not reach.
    Options: ``measure`` (default True) lets the cost model decide per group; False merges
    every group.
    """
    if ctx.training:
        return PassResult(gm, False)
    measure = bool(ctx.options.get("measure", True)) and ctx.cost is not None
    counts = {"merged_groups": 0, "merged_linears": 0, "kept_separate": 0}
    order = {n: i for i, n in enumerate(gm.graph.nodes)}  # the original nodes keep theirs
    for x in list(gm.graph.nodes):
        group = _siblings(gm, x, order)
        if len(group) < 2:
            continue
        linears = [node for node, _, _ in group]
        weights = [w for _, w, _ in group]
        biases = [b for _, _, b in group]
        # The stacked copy, made to be measured and then kept where it pays.
        need = sum(t.numel() * t.element_size() for t in [*weights, *biases] if t is not None)
        if memory.allowance().shortfall(need, "merge_linear's merged weights"):
            counts["kept_for_memory"] = counts.get("kept_for_memory", 0) + 1
            continue
        if measure and not _pays(ctx, meta_val(x), weights, biases):
            counts["kept_separate"] += 1
            continue
        weight, bias = _stacked(weights, biases)
        sources = [call_kwargs(node)["weight"] for node in linears]
        _merge(gm, x, linears, weight, bias, [w.shape[0] for w in weights],
               [(str(n.target), weakref.ref(w)) for n, w in zip(sources, weights, strict=True)])
        counts["merged_groups"] += 1
        counts["merged_linears"] += len(group)
    counts = {k: v for k, v in counts.items() if v}
    if "merged_groups" in counts:
        gm.recompile()
    return PassResult(gm, "merged_groups" in counts, counts)


def _siblings(gm: GraphModule, x: Node, order: dict[Node, int],
              ) -> list[tuple[Node, torch.Tensor, torch.Tensor | None]]:
    """The linear ops reading ``x`` whose weights (and biases) are constant tensors of x's
    dtype on one device, in graph order, as (node, weight, bias)."""
    value = meta_val(x)
    if not isinstance(value, torch.Tensor):
        return []
    found = []
    for user in x.users:
        if user.target not in ops.LINEAR.aten:  # reads ATen's (input, weight, bias)
            continue
        kw = call_kwargs(user)
        if kw is None or kw.get("input") is not x:
            continue
        weight, bias = kw.get("weight"), kw.get("bias")
        w = constant_tensor(gm, weight)
        if w is None or w.dim() != 2:
            continue
        b = None
        if bias is not None:
            b = constant_tensor(gm, bias)
            if b is None or b.shape != w.shape[:1] or b.dtype != w.dtype:
                continue
        found.append((user, w, b))
    kinds = {(w.dtype, w.device) for _, w, _ in found}
    if len(kinds) != 1 or next(iter(kinds))[0] != value.dtype:
        return []
    return sorted(found, key=lambda item: order[item[0]])


def _stacked(weights: Sequence[torch.Tensor], biases: Sequence[torch.Tensor | None],
             ) -> tuple[torch.Tensor, torch.Tensor | None]:
    weight = torch.cat([w.detach() for w in weights])
    if all(b is None for b in biases):
        return weight, None
    bias = torch.cat([b.detach() if b is not None else w.new_zeros(w.shape[0])
                      for w, b in zip(weights, biases, strict=True)])
    return weight, bias


def _merge(gm: GraphModule, x: Node, linears: Sequence[Node], weight: torch.Tensor,
           bias: torch.Tensor | None, sizes: list[int],
           sources: list[tuple[str, weakref.ref[torch.Tensor]]]) -> None:
    graph = gm.graph
    with graph.inserting_before(linears[0]):  # x and the weights exist by then
        w_node = add_constant(gm, "merged_linear_weight", weight)
        # How to compute it again from the weights it stacks (their get_attr targets and
        # tensors): the lowerings and the graph kept for export read it as a concatenation
        # of those, so that a lowering's packed copy is the only one
        # (``autoopt.compile.pass_runner``).
        w_node.meta[MERGED_FROM] = sources
        b_node = add_constant(gm, "merged_linear_bias", bias) if bias is not None else None
        wide = graph.call_function(aten.linear.default, (x, w_node, b_node))
        wide.meta["val"] = aten.linear.default(meta_val(x), w_node.meta["val"],
                                               b_node.meta["val"] if b_node else None)
        parts = graph.call_function(aten.split_with_sizes.default, (wide, sizes, -1))
        parts.meta["val"] = aten.split_with_sizes.default(wide.meta["val"], sizes, -1)
        for i, old in enumerate(linears):
            part = graph.call_function(operator.getitem, (parts, i))
            part.meta = {**old.meta, "val": parts.meta["val"][i]}
            old.replace_all_uses_with(part)
    for old in linears:
        graph.erase_node(old)


def _pays(ctx: PassContext, x_meta: torch.Tensor, weights: Sequence[torch.Tensor],
          biases: Sequence[torch.Tensor | None]) -> bool:
    """Whether the merged form measures at least as fast as the separate linears, on a random
    input of the real shape. The stacked copy of the weights is made only to measure it, and
    not at all where this shape's choice is cached (a decoder's repeated layers)."""
    shape = size_hints(x_meta)  # a symbolic size (``dynamic=``): measured as traced
    if shape is None:
        return False  # no single shape to measure at
    x = torch.randn(shape, dtype=x_meta.dtype, device=weights[0].device)
    sizes = [w.shape[0] for w in weights]
    what = (f"linear_group|{tuple(x.shape)}|{[tuple(w.shape) for w in weights]}|{x.dtype}|"
            f"bias={[b is not None for b in biases]}")
    stacked = functools.cache(lambda: _stacked(weights, biases))
    best, seconds = ctx.cost.fastest(what, {
        "merged": lambda: F.linear(x, *stacked()).split(sizes, -1),
        "separate": lambda: [F.linear(x, w, b) for w, b in zip(weights, biases, strict=True)],
    })
    log.debug("%s: %s", what, seconds)
    return best == "merged"


def concatenations(gm: GraphModule) -> list[torch.fx.Node]:
    """The concatenations ``as_concatenations`` put in ``gm``."""
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.meta.get(CONCATENATED)]


def as_concatenations(gm: GraphModule) -> GraphModule:
    """A copy of ``gm`` reading each merged weight (``merge_linear``) as the concatenation of
    the user's weights it stacks, holding no copy of its own: the graph kept for export, and
    the one the lowerings start from. ``gm`` itself where it has no merged weight (or one
    whose sources are gone)."""
    nodes = [n for n in gm.graph.nodes if n.op == "get_attr" and n.meta.get(MERGED_FROM)
             and isinstance(attr(gm, n), torch.Tensor)]
    if not nodes:
        return gm
    new = copy_graph_module(gm)
    by_name = {n.name: n for n in new.graph.nodes}
    first = next(n for n in new.graph.nodes if n.op != "placeholder")
    changed = False
    for old in nodes:
        node = by_name[old.name]
        sources = [(target, ref()) for target, ref in node.meta[MERGED_FROM]]
        if any(t is None or not _has_or_sets(new, target, t) for target, t in sources):
            continue  # a stacked weight is gone or shadowed: keep the merged copy
        with new.graph.inserting_before(first):
            parts = [new.graph.get_attr(target) for target, _ in sources]
        for part, (_, t) in zip(parts, sources, strict=True):
            part.meta["val"] = fake_like(new, t)
        with new.graph.inserting_before(node):
            cat = new.graph.call_function(torch.ops.aten.cat.default, (parts, 0))
        cat.meta = {k: v for k, v in node.meta.items() if k != MERGED_FROM}
        cat.meta[CONCATENATED] = True
        node.replace_all_uses_with(cat)
        new.graph.erase_node(node)
        if str(node.target) not in {str(n.target) for n in new.graph.nodes if n.op == "get_attr"}:
            delattr(new, str(node.target))
        changed = True
    if not changed:
        return gm
    new.recompile()
    return new


def fold_concatenations(gm: GraphModule, values: dict[str, torch.Tensor] | None = None,
                         ) -> dict[str, torch.Tensor]:
    """Undo ``as_concatenations`` where a concatenation is still read (a linear left on
    aten): one merged copy again, computed once instead of per call (or taken from
    ``values``, by node name); unread ones go. Returns the merged copies made, by node name."""
    made: dict[str, torch.Tensor] = {}
    for cat in concatenations(gm):
        parts = list(cat.args[0])
        if cat.users and (values is None or cat.name in values):
            value = (values[cat.name] if values is not None
                     else torch.cat([attr(gm, p).detach() for p in parts]))
            with gm.graph.inserting_before(cat):
                node = add_constant(gm, "merged_linear_weight", value)
            cat.replace_all_uses_with(node)
            made[cat.name] = value
        elif cat.users:
            continue
        gm.graph.erase_node(cat)
        for part in parts:
            if not part.users:
                gm.graph.erase_node(part)
    gm.recompile()
    return made


def _has_or_sets(gm: GraphModule, target: str, tensor: torch.Tensor) -> bool:
    """Whether ``gm`` has ``tensor`` at ``target``, putting it there if nothing is; False
    where another value holds the name."""
    *path, name = target.split(".")
    owner: nn.Module = gm
    for atom in path:
        child = getattr(owner, atom, None)
        if child is None:
            child = nn.Module()
            owner.add_module(atom, child)
        if not isinstance(child, nn.Module):
            return False
        owner = child
    current = getattr(owner, name, None)
    if current is None:
        if isinstance(tensor, nn.Parameter):
            owner.register_parameter(name, tensor)
        else:
            owner.register_buffer(name, tensor)
        return True
    return current is tensor
