"""Remove nodes whose results nobody reads.

    x ─ a ─ y          x ─ a ─ y
     └─ b (unused) ⟶
"""

from __future__ import annotations

from torch.fx import GraphModule

from .base import PassContext, PassResult


def eliminate_dead_code(gm: GraphModule, ctx: PassContext) -> PassResult:
    """Erase pure nodes with no users; in-place updates (BatchNorm statistics) and guards stay.

    FX's ``eliminate_dead_code`` already refuses to erase impure nodes (mutating ATen overloads,
    modules marked impure such as export's input guards); this pass adds the count.

    Args:
        gm: the graph module, rewritten in place.
        ctx: unused; dead-code removal needs no cost model.
    """
    before = len(gm.graph.nodes)
    modified = gm.graph.eliminate_dead_code()
    removed = before - len(gm.graph.nodes)
    if modified:
        gm.recompile()
    return PassResult(gm, bool(modified), {"dead_nodes": removed} if removed else {})
