"""What executes an optimized graph: ``aten``, ``hybrid``, ``inductor``, ``onnxruntime`` or
``openvino``, by measurement.

After the graph passes, each optimized graph (each specialization's whole graph, each Dynamo
subgraph) is lowered by every candidate backend that can take it, each lowering is verified
against eager like a pass, and the fastest correct one runs the calls:

- ``aten``: the graph's own ATen kernels, with autoopt's lowerings (oneDNN convolutions, packed
  linears) and, on a GPU, CUDA graphs;
- ``hybrid``: TorchInductor generates the regions between autoopt's own kernels (the packed
  linears and oneDNN convolutions measured fastest per shape), which it calls as opaque ops;
- ``inductor``: TorchInductor generates fused kernels for the graph from before autoopt's
  lowerings (C++/OpenMP with oneDNN weight prepacking on a CPU, Triton on a GPU), through
  AOTAutograd for a graph with gradients;
- ``onnxruntime``: inference graphs exported to ONNX and run in-process by ONNX Runtime, torch
  tensors in and out;
- ``openvino``: the same ONNX file compiled by OpenVINO for the CPU (f32 unless ``precision=``
  asks otherwise), called in-process.

Each backend is one module here holding ``BACKEND`` (the protocol is in ``base``); its name is
listed in ``autoopt.options.backends``. ``choose_backend`` (``choice``) does the measuring
through the cost model, which caches the result on disk. Nothing heavy is imported here:
``import autoopt`` stays fast.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from autoopt.options.backends import BACKENDS, BACKENDS_VARIABLE, INDUCTOR_OPTIONS

if TYPE_CHECKING:
    from autoopt.backends.base import Backend, Lowering

__all__ = ["BACKENDS", "BACKENDS_VARIABLE", "INDUCTOR_OPTIONS", "backend", "offers"]


def backend(name: str) -> Backend:
    """The backend named ``name`` (one of ``BACKENDS``): its module's ``BACKEND``."""
    if name not in BACKENDS:
        raise ValueError(f"unknown backend {name!r}; the backends are {BACKENDS}")
    return importlib.import_module(f"{__name__}.{name}").BACKEND


def offers(names: tuple[str, ...] | list[str], kind: str, graph: Any,
           ) -> tuple[list[Lowering], dict[str, str]]:
    """Each backend of ``names`` offered ``graph`` (``kind``: ``"whole_graph"`` or
    ``"subgraph"``): the candidates it gave, in order, and why the others do not apply."""
    lowerings: list[Lowering] = []
    skipped: dict[str, str] = {}
    for name in names:
        offer = getattr(backend(name), kind)(graph)
        if isinstance(offer, str):
            skipped[name] = offer
        else:
            lowerings.append(offer)
    return lowerings, skipped
