"""The backend for one Dynamo subgraph, offered to each backend the user allows: today
``aten`` (the optimized graph) or ``inductor``.

A Dynamo subgraph takes flat tensors (its parameters among them) and is lowered by Inductor
exactly as ``torch.compile``'s default backend lowers it (``compile_fx``, inside Dynamo's
tracing context). ONNX Runtime does not apply: a subgraph is one piece of a forward whose
Python runs in between, and exporting each piece would cost more than it saves.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from torch.fx import GraphModule

from autoopt.backends import inductor, offers
from autoopt.backends.base import Subgraph
from autoopt.backends.choice import choose_backend
from autoopt.backends.whole_graph import identity
from autoopt.check.compare import VerifyResult
from autoopt.check.inputs import clone_inputs
from autoopt.check.report import BackendChoice
from autoopt.check.state import preserved
from autoopt.cost_model import CostModel
from autoopt.options.config import OptimizeConfig
from autoopt.passes.graph import portable, written_placeholders, written_tensors


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
    if gradients:
        inductor.keep_backward_buffers()  # for inductor, and aot_eager (checkpointed regions)
    graph = Subgraph(optimized, example_inputs, inputs, config, gradients)
    lowerings, skipped = offers(config.candidate_backends, "subgraph", graph)

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
