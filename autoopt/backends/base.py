"""The Backend protocol: what an engine says about a graph, and how it is built.

A backend is one module of this package (its name is the module's, listed in
``autoopt.options.backends.BACKENDS``) holding ``BACKEND``, an object with two methods, one per
kind of graph autoopt lowers:

- ``whole_graph(graph: WholeGraph) -> Lowering | str``: a captured whole graph
  (``torch.export`` or ``symbolic_trace``), after the passes;
- ``subgraph(graph: Subgraph) -> Lowering | str``: a graph Dynamo hands over under
  ``torch.compile(backend="autoopt")``.

Each returns the candidate's ``Lowering`` (how to build it, what building it costs, what the
report says of it), or, where the backend does not take this graph (not installed, gradients,
a dtype it lacks, a device it has no provider for), why not, in one line for the report. Both
compile paths (``whole_graph.py``, ``subgraph.py``) loop over the names the user allows and let
``choice.choose_backend`` verify and measure what was offered: adding an engine is one module
here and one name in that list.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.fx import GraphModule

from autoopt.check.inputs import clone_inputs
from autoopt.check.state import preserved
from autoopt.cost_model import CostModel
from autoopt.onnx import graph as onnx_graph
from autoopt.options.config import OptimizeConfig


@dataclass
class Lowering:
    """One backend's lowering of a graph: ``build()`` returns what to call, or raises.

    ``verified``: the result is already checked against eager (the pass driver's graph).
    ``memory``: about how many bytes building it adds (its copies of the weights, its
    compiler's working set), checked against what optimize may still add.
    ``regions``: where it runs more than one kernel library, how the graph is split between
    them (for the report, when it is chosen).
    ``release``: drops what the built callable holds and can make again (its packed weights),
    returning the bytes dropped; the callable still works, making them again when called.
    ``restore``: makes them again now.
    ``dominated_by``: another candidate's name and why this one is not worth building once
    that one is (it can at most tie it); once that one is built and verified for the graph,
    this one is skipped with the reason (not built, not measured).
    ``at_best``: given the times over eager's measured so far (by candidate), the least time
    over eager's this one can take and why (None: not known yet). A candidate with a bound is
    built after those without, and only where its bound beats the fastest of them: an
    Inductor compile (10-15 s cold) is not spent where it cannot win. ``at_best.reads``,
    where it has one, names the candidate whose time the bound reads, which a prediction from
    similar graphs then does not leave out.
    """

    name: str
    build: Callable[[], Callable[..., Any]]
    verified: bool = False
    memory: int = 0
    regions: Callable[[], str] | None = None
    release: Callable[[], int] | None = None
    restore: Callable[[], None] | None = None
    dominated_by: tuple[str, str] | None = None
    at_best: Callable[[Mapping[str, float]], tuple[float, str] | None] | None = None



@dataclass
class WholeGraph:
    """One captured whole graph, as every backend is offered it.

    ``gm``: the optimized graph (after the passes and any memory plan); ``source``: the graph
    from before autoopt's own lowerings (``portable(gm)``), which other engines lower;
    ``aten``: what runs ``gm`` on the ``aten`` backend (the graph, its CUDA graph, or the model
    where no pass changed anything), already verified; ``module``: the model (autoopt's copy),
    which ``args, kwargs`` are the inputs of; ``adapt``: turns a callable taking the graph's
    positional inputs into one taking the model's (``symbolic_trace``), None where the graph
    takes the model's arguments (``torch.export``); ``gradients``: a gradient can flow through
    the calls; ``dynamic``: some sizes are symbolic; ``memory_plan``: ``memory_budget``'s plan
    was applied to the aten graph; ``packed``: ``release``/``restore`` of the aten lowering's
    packed weights, which ``hybrid`` calls too; ``exports``: one ONNX export shared by the
    engines that read ONNX; ``cost_model``: estimates of the graph's nodes (None: none).
    """

    gm: GraphModule
    source: GraphModule
    aten: Callable[..., Any]
    module: nn.Module
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    config: OptimizeConfig
    device: torch.device
    adapt: Callable[[Callable[..., Any]], Callable[..., Any]] | None
    gradients: bool
    dynamic: bool
    memory_plan: bool
    packed: dict[str, Callable[..., Any]] = field(default_factory=dict)
    exports: onnx_graph.Exports = field(default_factory=onnx_graph.Exports)
    cost_model: CostModel | None = None

    def call(self, run: Callable[..., Any]) -> Callable[..., Any]:
        """``run`` taking the model's arguments."""
        return self.adapt(run) if self.adapt is not None else run

    def warm(self, run: Callable[..., Any]) -> Callable[..., Any]:
        """``run``, called once on a copy of the inputs. An engine that compiles on the first
        call (Inductor) fails here, as a skipped candidate, never on the user's first call."""
        a, k = clone_inputs(self.args, self.kwargs)
        with preserved(self.module):
            torch.manual_seed(0)
            run(*a, **k)
        return run

    def expected(self) -> Any:
        """The model's output on the example inputs, whose structure an ONNX file's outputs
        are put back into."""
        a, k = clone_inputs(self.args, self.kwargs)
        with torch.no_grad(), preserved(self.module):
            return self.module(*a, **k)

    def settings(self, name: str) -> dict[str, Any]:
        """What the user set for backend ``name`` (``backend_options=``)."""
        return dict(self.config.backend_options.get(name, {}))


@dataclass
class Subgraph:
    """One graph Dynamo hands over: ``optimized`` after the passes (verified),
    ``example_inputs`` as Dynamo gave them (symbolic sizes included), ``inputs`` the same made
    concrete; ``gradients``: a gradient can flow through it."""

    optimized: GraphModule
    example_inputs: Sequence[Any]
    inputs: list[Any]
    config: OptimizeConfig
    gradients: bool


class Backend:
    """An engine that runs graphs; ``name`` is its module's. The defaults take no graph."""

    name = ""

    def whole_graph(self, graph: WholeGraph) -> Lowering | str:
        return f"{self.name} does not run whole graphs"

    def subgraph(self, graph: Subgraph) -> Lowering | str:
        return ("a Dynamo subgraph is one piece of a forward whose Python runs in between; it "
                "is lowered by aten or inductor")
