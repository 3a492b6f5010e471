"""Attention with a mask, written for ONNX the way torch computes it on fully masked rows.

Every torch kernel of ``scaled_dot_product_attention`` gives zeros for a query row whose mask
allows no position (a boolean row all False, a float row all ``-inf``): an empty text padded
into a batch. The exporter's translation does not (a tiny BERT's empty row came out 0.01-0.06
off under ONNX Runtime). ``with_empty_rows_zeroed`` returns a graph module for the exporter in
which each masked attention's result is zeroed where its mask row allows nothing: the same
function in torch, and the same in ONNX.
"""

from __future__ import annotations

import copy
import math

import torch
from torch.fx import Graph, GraphModule, Node

_ATTENTION = torch.ops.aten.scaled_dot_product_attention.default


def with_empty_rows_zeroed(gm: GraphModule) -> GraphModule:
    """``gm`` itself where no attention takes a mask, else a copy of it (the weights shared,
    ``gm`` untouched: it may be serving calls) with the masked attentions rewritten."""
    if not any(_mask_of(node) is not None for node in gm.graph.nodes):
        return gm
    graph = copy.deepcopy(gm.graph)  # nodes' meta is copied shallowly: no tensor copies
    for node in list(graph.nodes):
        mask = _mask_of(node)
        if mask is not None:
            _zero_empty_rows(graph, node, mask)
    graph.lint()
    out = GraphModule(gm, graph, class_name=type(gm).__name__)
    out.meta.update(gm.meta)
    return out


def _mask_of(node: Node) -> Node | None:
    """The mask node of a masked attention whose mask dtype is known, else None."""
    if node.op != "call_function" or node.target is not _ATTENTION:
        return None
    mask = node.args[3] if len(node.args) > 3 else node.kwargs.get("attn_mask")
    if not isinstance(mask, Node) or not isinstance(mask.meta.get("val"), torch.Tensor):
        return None
    return mask


def _zero_empty_rows(graph: Graph, node: Node, mask: Node) -> None:
    aten = torch.ops.aten
    with graph.inserting_before(node.next):  # in order (inserting_after reverses them)
        if mask.meta["val"].dtype == torch.bool:
            allowed = mask
        else:  # a float mask: -inf is the one value that removes a position for certain
            allowed = graph.call_function(aten.gt.Scalar, (mask, -math.inf))
        any_allowed = graph.call_function(aten.any.dim, (allowed, -1, True))
        zeroed = graph.call_function(aten.where.ScalarOther, (any_allowed, node, 0.0))
    node.replace_all_uses_with(zeroed, delete_user_cb=lambda user: user is not zeroed)
