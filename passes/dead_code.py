"""Remove nodes whose results nobody reads.

    x ─ a ─ y          x ─ a ─ y
     └─ b (unused) ⟶
"""

from __future__ import annotations

from torch.fx import GraphModule

from .base import PassContext, PassResult
from .graph import is_impure


def eliminate_dead_code(gm: GraphModule, ctx: PassContext) -> PassResult:
    """Erase pure nodes with no users; in-place updates (BatchNorm statistics) and guards stay.

    Purity is ``graph.is_impure``'s, not FX's default: FX reads mutation from ATen schemas
    only, so in a Dynamo or ``symbolic_trace`` graph it would erase ``count.add_(1)``,
    ``x.mul_(2)`` or a training BatchNorm whose output is unused.

    Args:
        gm: the graph module, rewritten in place.
        ctx: unused; dead-code removal needs no cost model.
    """
    before = len(gm.graph.nodes)
    modified = gm.graph.eliminate_dead_code(is_impure_node=is_impure)
    removed = before - len(gm.graph.nodes)
    if modified:
        gm.recompile()
    return PassResult(gm, bool(modified), {"dead_nodes": removed} if removed else {})
