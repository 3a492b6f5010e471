"""Replace a GELU written out elementwise by the one fused ``aten.gelu`` kernel.

    x ─ pow 3 ─ ×0.044715 ─ +x ─ ×√(2/π) ─ tanh ─ +1 ─┐
    x ─ ×0.5 ──────────────────────────────────────────× ─ y   ⟶   x ─ gelu(tanh) ─ y

    x ─ ×1/√2 ─ erf ─ +1 ─┐
    x ─ ×0.5 ─────────────× ─ y                              ⟶   x ─ gelu ─ y

Eight (or five) passes over the activation become one; GPT-2's ``NewGELUActivation`` and many
hand-written MLPs take the first form.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch.fx import GraphModule, Node

from . import ops
from .base import PassContext, PassResult
from .graph import is_call, meta_val

aten = torch.ops.aten
_SQRT_2_OVER_PI = math.sqrt(2 / math.pi)
_INV_SQRT_2 = 1 / math.sqrt(2)


def replace_gelu(gm: GraphModule, ctx: PassContext) -> PassResult:
    """Rewrite matched GELU expressions to ``aten.gelu``.

    Args:
        gm: the graph module, rewritten in place.
        ctx: unused.
    """
    counts = {"gelu_tanh": 0, "gelu_erf": 0}
    for node in list(gm.graph.nodes):
        match = _match(node)
        if match is None:
            continue
        x, approximate, chain = match
        if not _safe(x, node, chain):
            continue
        with gm.graph.inserting_before(node):
            fused = gm.graph.call_function(aten.gelu.default, (x,), {"approximate": approximate})
        fused.meta.update(node.meta)
        node.replace_all_uses_with(fused)
        for dead in [node, *chain]:  # consumers before producers
            if not dead.users:
                gm.graph.erase_node(dead)
        counts["gelu_tanh" if approximate == "tanh" else "gelu_erf"] += 1
    counts = {k: v for k, v in counts.items() if v}
    if counts:
        gm.recompile()
    return PassResult(gm, bool(counts), counts)


def _match(out: Node) -> tuple[Node, str, list[Node]] | None:
    """``(x, approximate, inner nodes)`` when ``out`` is ``(x * 0.5) * (1 + f(x))``."""
    if not is_call(out, ops.MULTIPLY) or len(out.args) != 2:
        return None
    for half, one_plus in (out.args, out.args[::-1]):
        x = _times(half, 0.5)
        inner = _plus_one(one_plus)
        if x is None or inner is None:
            continue
        if is_call(inner, ops.TANH) and len(inner.args) == 1 and not inner.kwargs:
            found = _tanh_argument(inner.args[0], x)
            if found is not None:
                return x, "tanh", [half, one_plus, inner, *found]
        if is_call(inner, ops.ERF) and len(inner.args) == 1 and not inner.kwargs:
            scaled = inner.args[0]
            if _times(scaled, _INV_SQRT_2) is x or _divided(scaled, math.sqrt(2)) is x:
                return x, "none", [half, one_plus, inner, scaled]
    return None


def _tanh_argument(node: Any, x: Node) -> list[Node] | None:
    """Nodes of ``√(2/π) * (x + 0.044715 * x**3)`` if ``node`` is that, else None."""
    inner = _times(node, _SQRT_2_OVER_PI)
    if not is_call(inner, ops.ADD) or len(inner.args) != 2 or inner.kwargs:
        return None
    a, b = inner.args
    cubic = b if a is x else a if b is x else None
    cube = _times(cubic, 0.044715)
    if not is_call(cube, ops.POW) or len(cube.args) != 2 or cube.kwargs:
        return None
    if cube.args[0] is not x or not _close(cube.args[1], 3.0):
        return None
    return [node, inner, cubic, cube]


def _times(node: Any, constant: float) -> Node | None:
    """``y`` when ``node`` is ``y * constant`` or ``constant * y``."""
    if not is_call(node, ops.MULTIPLY) or len(node.args) != 2 or node.kwargs:
        return None
    a, b = node.args
    if isinstance(a, Node) and _close(b, constant):
        return a
    if isinstance(b, Node) and _close(a, constant):
        return b
    return None


def _divided(node: Any, constant: float) -> Node | None:
    if not is_call(node, ops.DIVIDE) or len(node.args) != 2 or node.kwargs:
        return None
    a, b = node.args
    return a if isinstance(a, Node) and _close(b, constant) else None


def _plus_one(node: Any) -> Node | None:
    if not is_call(node, ops.ADD) or len(node.args) != 2 or node.kwargs:
        return None
    a, b = node.args
    if isinstance(a, Node) and _close(b, 1.0):
        return a
    if isinstance(b, Node) and _close(a, 1.0):
        return b
    return None


def _safe(x: Node, out: Node, chain: list[Node]) -> bool:
    """A floating ``x`` whose GELU has its shape and dtype, and intermediate results that only
    this expression reads (otherwise they must still be computed)."""
    val, result = meta_val(x), meta_val(out)
    if not isinstance(val, torch.Tensor) or not isinstance(result, torch.Tensor):
        return False
    if not val.is_floating_point() or val.dtype != result.dtype or val.shape != result.shape:
        return False
    return all(len(n.users) == 1 for n in chain)


def _close(value: Any, expected: float) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and math.isclose(value, expected, rel_tol=1e-4))
