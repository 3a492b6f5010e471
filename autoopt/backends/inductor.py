"""TorchInductor as a backend: fused kernels generated for one optimized graph.

The graph handed over is the one from before autoopt's lowering passes (``driver.portable``):
Inductor packs weights for its own GEMMs (``freezing``), which autoopt's packed-linear and
oneDNN-convolution objects would hide from it. ``freezing`` applies to inference graphs only:
it folds the weights into the generated code as constants, which the graph's watched-weights
stamp already treats as copies (a write to a weight re-captures). A graph with gradients goes
through AOTAutograd, which partitions the joint forward/backward graph and compiles both.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.fx import GraphModule

from ..driver import copy_graph_module


def lower(gm: GraphModule, *, dynamic: bool, gradients: bool) -> Callable[..., Any]:
    """``gm`` compiled by Inductor; compilation happens on the first call.

    A private copy of the graph module is compiled, so that dropping the result (a candidate
    that lost) also drops what Dynamo cached for it, frozen weights included.
    """
    graph = copy_graph_module(gm)
    return torch.compile(graph, backend="inductor", fullgraph=True, dynamic=dynamic,
                         options={"freezing": not gradients})


def available() -> str:
    """Why Inductor cannot run here, or ''."""
    try:
        import torch._inductor.compile_fx  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - any import failure means: not here
        return f"Inductor cannot be imported ({type(exc).__name__}: {exc})"
    return ""
