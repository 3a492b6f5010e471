"""Write an optimized module out."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch.fx import GraphModule
from torch.fx._pytree import tree_flatten_spec
from torch.fx.experimental.symbolic_shapes import is_concrete_int

from autoopt.capture.graph import dynamic_shapes_for
from autoopt.errors import ModelError
from autoopt.passes.graph import portable


def save_program(optimized: Any, args: tuple[Any, ...], kwargs: Mapping[str, Any],
                 path: str) -> None:
    """Save the graph ``optimized`` runs for these inputs as a ``torch.export`` ``.pt2`` file.

    Only whole-graph captures can be saved; a model that runs partly eagerly cannot. The
    dimensions the graph keeps symbolic (``dynamic=True``, ``dynamic_shapes=``) stay dynamic
    in the program.
    """
    # The inference graph (an eval model is captured under no_grad).
    with torch.no_grad():
        served = optimized.specialization_for(tuple(args), dict(kwargs))
    graph = served.graph
    if not isinstance(graph, GraphModule) or served.method != "export":
        raise ModelError(f"cannot save: the model was captured by {served.method!r}, "
                         "not as one whole graph, so there is no single program to write. "
                         "Make the model exportable (see the report's capture attempts).")
    gm = portable(graph)
    program = torch.export.export(gm, tuple(args), dict(kwargs), strict=False,
                                  dynamic_shapes=symbolic_dims(gm, tuple(args), dict(kwargs)))
    torch.export.save(program, path)


def symbolic_dims(gm: GraphModule, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``dynamic_shapes`` marking each input dimension that is symbolic in ``gm`` (``None``
    when all are static): exporting the graph again with example inputs alone would fix every
    size to the example's.

    ``Dim.DYNAMIC``: export infers the range again and fails rather than silently fixing a
    dimension the graph holds symbolic.
    """
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    in_spec = getattr(gm, "_in_spec", None)
    if in_spec is None:
        return None
    leaves = tree_flatten_spec((list(args), kwargs), in_spec)
    symbolic: dict[int, dict[int, Any]] = {}
    for leaf, node in zip(leaves, placeholders, strict=False):
        value = node.meta.get("val")
        if isinstance(leaf, torch.Tensor) and isinstance(value, torch.Tensor):
            dims = {d: torch.export.Dim.DYNAMIC for d, size in enumerate(value.shape)
                    if not is_concrete_int(size)}
            if dims:
                symbolic[id(leaf)] = dims
    if not symbolic:
        return None
    return dynamic_shapes_for(gm.forward, args, kwargs, lambda t: symbolic.get(id(t)))
