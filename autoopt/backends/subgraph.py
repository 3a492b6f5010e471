"""The backend for one Dynamo subgraph: ``aten`` (the optimized graph) or ``inductor``.

A Dynamo subgraph takes flat tensors (its parameters among them) and is lowered by Inductor
exactly as ``torch.compile``'s default backend lowers it (``compile_fx``, inside Dynamo's
tracing context). ONNX Runtime does not apply: a subgraph is one piece of a forward whose
Python runs in between, and exporting each piece would cost more than it saves.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.fx import GraphModule

from autoopt.backends import inductor
from autoopt.backends.choice import Lowering, choose_backend
from autoopt.backends.whole_graph import identity
from autoopt.check.compare import VerifyResult, clone_inputs
from autoopt.check.report import BackendChoice
from autoopt.check.state import preserved
from autoopt.compile.pass_runner import copy_graph_module, portable
from autoopt.cost_model import CostModel
from autoopt.options.config import OptimizeConfig
from autoopt.passes.graph import written_placeholders, written_tensors


def lower_subgraph(optimized: GraphModule, example_inputs: Sequence[Any], inputs: list[Any], *,
                   label: str, config: OptimizeConfig, cost_model: CostModel,
                   verify: Callable[[Callable[..., Any]], VerifyResult] | None,
                   gradients: bool) -> tuple[Callable[..., Any], BackendChoice]:
    """What Dynamo runs for this subgraph, and the record of the choice.

    Args:
        optimized: the subgraph after the passes (verified).
        example_inputs: what Dynamo gave (symbolic sizes included), for Inductor.
        inputs: the same made concrete, to verify and time on.
        gradients: a gradient can flow through it.
    """
    lowerings, skipped = [], {}
    if gradients:
        inductor.keep_backward_buffers()  # for inductor, and aot_eager (checkpointed regions)
    for name in config.candidate_backends:
        if name == "aten":
            if gradients and _checkpointed(optimized):
                lowerings.append(Lowering("aten", lambda: _aot_eager(optimized, example_inputs)))
            else:
                lowerings.append(Lowering("aten", lambda: optimized, verified=True))
        elif name == "inductor":
            why = inductor.available() or (
                inductor.partial_gradients(optimized, inputs) if gradients else "")
            if why:
                skipped[name] = why
            else:
                lowerings.append(Lowering(name, lambda: _inductor(
                    optimized, example_inputs, dict(config.backend_options.get("inductor", {}))),
                    memory=inductor.memory_estimate(portable(optimized), gradients)))
        elif name == "hybrid":
            # Its weights are inputs, not constants, so no weight is packed for autoopt's
            # kernels: hybrid would be the inductor backend.
            skipped[name] = "no autoopt kernel in a Dynamo subgraph (its weights are inputs)"
        else:
            skipped[name] = ("a Dynamo subgraph is one piece of a forward whose Python runs "
                             "in between; it is lowered by aten or inductor")

    def timer(run: Callable[..., Any]) -> Callable[[], Any]:
        # The forward alone, with gradients recorded where they flow: this runs inside
        # Dynamo's compilation of the frame, and a backward here would make AOTAutograd
        # compile Inductor's backward graph nested in it, which Dynamo's bookkeeping refuses
        # (the frame's compile then fails). Verification of the whole module, after Dynamo is
        # done, runs the backward and compares the gradients.
        private, _ = clone_inputs(tuple(inputs), {}, written_placeholders(optimized))
        return lambda: run(*private)

    what = identity(optimized, portable(optimized), tuple(inputs), {}, gradients, False,
                    config.backend_options)
    # What the subgraph writes that is not an input (Dynamo reads a compiled optimizer's
    # parameters and momentum as attributes) is put back after the candidates' runs.
    with preserved(written_tensors(optimized)):
        return choose_backend(label, lowerings, skipped, verify=verify, timer=timer,
                              cost_model=cost_model, what=what,
                              required=config.backend is not None, gradients=gradients)


def _inductor(optimized: GraphModule, example_inputs: Sequence[Any],
              settings: dict[str, Any]) -> Callable[..., Any]:
    from torch._inductor import config as inductor_config
    from torch._inductor.compile_fx import compile_fx

    # A copy: Inductor rewrites the graph module it is given.
    with inductor_config.patch(inductor.config_of(settings)):
        return compile_fx(copy_graph_module(portable(optimized)), list(example_inputs))


def _checkpointed(gm: GraphModule) -> bool:
    """Whether ``gm`` holds a region ``torch.utils.checkpoint`` recomputes in the backward."""
    checkpoint = getattr(torch.ops.higher_order, "tag_activation_checkpoint", None)
    return checkpoint is not None and any(
        n.op == "call_function" and n.target is checkpoint for n in gm.graph.nodes)


def _aot_eager(optimized: GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
    """The graph run through AOTAutograd with no compiler. Dynamo hands a checkpointed region
    over with the random state's preservation off, leaving it to AOTAutograd: run as it is,
    the backward's recompute drew new dropout masks (gradients off by the whole gradient's
    scale, the forward exact)."""
    from torch._dynamo.backends.debugging import aot_eager

    return aot_eager(copy_graph_module(optimized), list(example_inputs))
