"""The interface every pass implements: ``fn(gm, ctx) -> PassResult``."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.fx import GraphModule


@dataclass(frozen=True)
class PassResult:
    """What a pass returns.

    Args:
        graph_module: the rewritten module (may be the one passed in).
        modified: whether anything changed; the driver skips re-verification when not.
        counts: how many rewrites of each kind fired, e.g. ``{"dropout": 12}``; shown in the report.
        note: why nothing changed where the user asked for this pass's work (the report
            says it).
    """

    graph_module: GraphModule
    modified: bool
    counts: Mapping[str, int] = field(default_factory=dict)
    note: str = ""


@dataclass(frozen=True)
class PassContext:
    """What a pass may read. A pass never times anything itself and never reads the environment.

    Args:
        example_inputs: one example value per placeholder of the graph, in placeholder order.
        device: the device the optimized module will run on.
        training: whether the module will be differentiated (a pass must keep gradients exact).
        cost: the cost model (``autoopt.cost_model``), or None where none was built.
        options: this pass's own options from the user's config, keyed by option name.
    """

    example_inputs: tuple[Any, ...] = ()
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    training: bool = False
    cost: Any = None
    options: Mapping[str, Any] = field(default_factory=dict)


# Passes receive a private copy of the graph: they may rewrite it in place, but must never
# mutate a tensor they did not create (parameters are shared with the user-visible copy).
PassFn = Callable[[GraphModule, PassContext], PassResult]
