"""The ``aten`` backend: the optimized graph's own ATen kernels, with autoopt's lowerings
(oneDNN convolutions, packed linears) and, on a GPU, CUDA graphs. The pass runner built and
verified it; this module offers it to the choice."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.fx import GraphModule

from autoopt.backends.base import Backend, Lowering, Subgraph, WholeGraph
from autoopt.passes.graph import copy_graph_module


class Aten(Backend):
    name = "aten"

    def whole_graph(self, graph: WholeGraph) -> Lowering:
        return Lowering(self.name, lambda: graph.aten, verified=True, **graph.packed)

    def subgraph(self, graph: Subgraph) -> Lowering:
        optimized = graph.optimized
        if graph.gradients and checkpointed(optimized):
            return Lowering(self.name, lambda: aot_eager(optimized, graph.example_inputs))
        return Lowering(self.name, lambda: optimized, verified=True)


BACKEND = Aten()


def checkpointed(gm: GraphModule) -> bool:
    """Whether ``gm`` holds a region ``torch.utils.checkpoint`` recomputes in the backward."""
    checkpoint = getattr(torch.ops.higher_order, "tag_activation_checkpoint", None)
    return checkpoint is not None and any(
        n.op == "call_function" and n.target is checkpoint for n in gm.graph.nodes)


def aot_eager(optimized: GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
    """The graph run through AOTAutograd with no compiler. Dynamo hands a checkpointed region
    over with the random state's preservation off, leaving it to AOTAutograd: run as it is,
    the backward's recompute drew new dropout masks (gradients off by the whole gradient's
    scale, the forward exact)."""
    from torch._dynamo.backends.debugging import aot_eager as aot_eager_backend

    return aot_eager_backend(copy_graph_module(optimized), list(example_inputs))
