"""Write an optimized module out."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch.fx import GraphModule

from .errors import ModelError
from .pipeline import portable


def save_program(optimized: Any, args: tuple[Any, ...], kwargs: Mapping[str, Any],
                 path: str) -> None:
    """Save the graph ``optimized`` runs for these inputs as a ``torch.export`` ``.pt2`` file.

    Only whole-graph captures can be saved; a model that runs partly eagerly cannot.
    """
    # The inference graph if there is one (an eval model is captured under no_grad).
    with torch.no_grad():
        spec = optimized._find(tuple(args), dict(kwargs))
    if spec is None:
        spec = optimized._find(tuple(args), dict(kwargs))
    if spec is None or not isinstance(spec.graph, GraphModule):
        method = spec.method if spec is not None else "none"
        raise ModelError(f"cannot save: the model was captured by {method!r}, not as one whole "
                         "graph, so there is no single program to write. Make the model "
                         "exportable (see the report's capture attempts).")
    program = torch.export.export(portable(spec.graph), tuple(args), dict(kwargs), strict=False)
    torch.export.save(program, path)
