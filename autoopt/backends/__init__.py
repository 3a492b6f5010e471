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

``choose_backend`` (``choice``) does the measuring through the cost model, which caches the
result on disk. Nothing heavy is imported here: ``import autoopt`` stays fast.
"""

from __future__ import annotations

BACKENDS: tuple[str, ...] = ("aten", "hybrid", "inductor", "onnxruntime", "openvino")
# A comma-separated list of backends: the default candidates when the config names none (a
# CI run or a serving fleet pins them without touching code).
BACKENDS_VARIABLE = "AUTOOPT_BACKENDS"

# What ``backend_options={"inductor": {...}}`` may set: torch.compile's ``mode`` (e.g.
# ``"max-autotune"``: Inductor benchmarks GEMM and convolution templates, minutes of compile
# for kernels that can be faster) and Inductor config ``options``.
INDUCTOR_OPTIONS: tuple[str, ...] = ("mode", "options")

__all__ = ["BACKENDS", "BACKENDS_VARIABLE", "INDUCTOR_OPTIONS"]
