"""The backend for one captured whole graph (``torch.export`` or ``symbolic_trace``).

``lower_whole_graph`` lists the candidates that apply to the graph (``aten`` is the pass
driver's verified result; Inductor, ONNX Runtime and OpenVINO lower the graph from before
autoopt's own lowerings) with why the others do not, and lets ``choose_backend`` verify and
measure them.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.fx import GraphModule
from torch.utils import _pytree as pytree

from autoopt.backends import hybrid, inductor, openvino
from autoopt.backends import onnxruntime as ort
from autoopt.backends.choice import Lowering, choose_backend
from autoopt.capture.graph import flat_example_inputs
from autoopt.check.compare import VerifyResult, clone_inputs
from autoopt.check.report import BackendChoice
from autoopt.check.state import preserved
from autoopt.compile.pass_runner import full_precision, portable
from autoopt.cost_model import CostModel
from autoopt.cost_model.estimate import value_spec
from autoopt.cost_model.isolation import written_placeholders
from autoopt.onnx import graph as onnx_graph
from autoopt.options.config import OptimizeConfig
from autoopt.passes.graph import release_packed, restore_packed


def lower_whole_graph(gm: GraphModule, aten: Callable[..., Any], module: nn.Module,
                      args: tuple[Any, ...], kwargs: dict[str, Any], *,
                      config: OptimizeConfig, cost_model: CostModel,
                      verify: Callable[[Callable[..., Any]], VerifyResult] | None,
                      adapt: Callable[[Callable[..., Any]], Callable[..., Any]] | None,
                      gradients: bool, dynamic: bool, memory_plan: bool,
                      device: torch.device) -> tuple[Callable[..., Any], BackendChoice]:
    """What runs the calls for ``gm`` and the record of the choice.

    Args:
        gm: the optimized graph (after the passes and any memory plan).
        aten: what runs it on the ``aten`` backend (the graph, its CUDA graph, or the model
            where no pass changed anything), already verified.
        module: the model (autoopt's copy), which ``args, kwargs`` are the inputs of.
        adapt: turns a callable taking the graph's positional inputs into one taking the
            model's (``symbolic_trace``); None: the graph takes the model's arguments
            (``torch.export``), which ONNX export needs.
        gradients: a gradient can flow through the calls.
        dynamic: the graph keeps some sizes symbolic.
        memory_plan: ``memory_budget``'s plan was applied to the aten graph.
    """
    source = portable(gm)
    names = config.candidate_backends
    lowerings, skipped = [], {}
    exports = onnx_graph.Exports()  # one export for ONNX Runtime and OpenVINO

    def call(run: Callable[..., Any]) -> Callable[..., Any]:
        return adapt(run) if adapt is not None else run

    def warm(run: Callable[..., Any]) -> Callable[..., Any]:
        # Inductor compiles on the first call: a compile error is a skipped candidate here,
        # never a failure of the user's first call.
        a, k = clone_inputs(args, kwargs)
        with preserved(module):
            torch.manual_seed(0)
            run(*a, **k)
        return run

    # The aten lowering's packed weights (hybrid calls the same kernels) can be dropped while
    # a backend with its own copies is built, and packed again if aten or hybrid stays fastest.
    packed = {"release": functools.partial(release_packed, gm),
              "restore": functools.partial(restore_packed, gm)}
    for name in names:
        if name == "aten":
            lowerings.append(Lowering("aten", lambda: aten, verified=True, **packed))
        elif name == "inductor":
            why = inductor.available() or (
                "memory_budget's plan (recompute, offload) is applied to the aten graph, "
                "and Inductor would plan saved activations its own way" if memory_plan else
                inductor.partial_gradients(source, [] if adapt is not None else
                                           flat_example_inputs(source, args, kwargs))
                or inductor.input_gradients(args, kwargs) if gradients else "")
            if why:
                skipped[name] = why
            else:
                lowerings.append(Lowering(name, lambda: warm(call(inductor.lower(
                    source, dynamic=dynamic, gradients=gradients,
                    settings=dict(config.backend_options.get("inductor", {}))))),
                    memory=inductor.memory_estimate(source, gradients),
                    dominated_by=_inductor_dominated(config, device)))
        elif name == "hybrid":
            why = inductor.available() or (
                "inference only (autoopt's kernels are inference lowerings, with no gradient)"
                if gradients else
                "memory_budget's plan (recompute, offload) is applied to the aten graph"
                if memory_plan else
                "no autoopt kernel in the graph: it would be the inductor backend"
                if not hybrid.opaque_nodes(gm) else "")
            if why:
                skipped[name] = why
            else:
                lowerings.append(Lowering(name, lambda: warm(call(hybrid.lower(
                    gm, None if adapt is not None else clone_inputs(args, kwargs),
                    dynamic=dynamic,
                    settings=dict(config.backend_options.get("inductor", {}))))),
                    regions=lambda: hybrid.regions(gm), **packed))
        elif name == "onnxruntime":
            why = ort.available() or (
                "inference only (ONNX Runtime computes no gradients)" if gradients else
                "the graph takes the model's inputs positionally (symbolic_trace); ONNX "
                "export needs a torch.export graph" if adapt is not None else
                "the graph writes its inputs in place (a KV cache); an ONNX graph returns "
                "new values and cannot" if written_placeholders(source) else
                f"no ONNX Runtime provider for {device.type}" if device.type not in
                ("cpu", "cuda") else ort.unsupported_dtypes(source, device))
            if why:
                skipped[name] = why
            else:
                lowerings.append(Lowering(name, lambda: warm(_onnxruntime(
                    source, module, args, kwargs, device, exports)),
                    memory=ort.memory_estimate(source)))
        elif name == "openvino":
            # Under precision="bf16", OpenVINO's own bf16 mode on the graph before autoopt's
            # casts: its hint, verified under the precision's tolerance like autoopt's map.
            precision, graph = _openvino_precision(gm, source, config)
            why = openvino.unsupported(graph, device, gradients, adapt is not None,
                                       bool(written_placeholders(graph)))
            if why:
                skipped[name] = why
            else:
                lowerings.append(Lowering(name, lambda graph=graph, precision=precision: warm(
                    _openvino(graph, module, args, kwargs, device, precision, exports)),
                    memory=openvino.memory_estimate(graph),
                    regions=lambda precision=precision: openvino.describe(precision)))

    writes_inputs = bool(written_placeholders(gm))

    def timer(run: Callable[..., Any]) -> Callable[[], Any]:
        a, k = clone_inputs(args, kwargs)
        if not gradients:
            return _Rerun(lambda: run(*a, **k), (a, k)) if writes_inputs else \
                lambda: run(*a, **k)
        wrt = [p for p in module.parameters() if p.requires_grad] + [
            x for x in pytree.tree_leaves((a, k))
            if isinstance(x, torch.Tensor) and x.requires_grad]

        def step() -> None:  # forward and backward; gradients returned, not accumulated
            outputs = [x for x in pytree.tree_leaves(run(*a, **k))
                       if isinstance(x, torch.Tensor) and x.requires_grad]
            if outputs and wrt:
                torch.autograd.grad(outputs, wrt, [torch.ones_like(x) for x in outputs],
                                    allow_unused=True)
        return step

    what = identity(gm, source, args, kwargs, gradients, dynamic, config.backend_options)
    with exports:
        return choose_backend("whole graph", lowerings, skipped, verify=verify, timer=timer,
                              cost_model=cost_model, what=what,
                              required=config.backend is not None, gradients=gradients,
                              state=[module], reference=module)


def _inductor_dominated(config: OptimizeConfig, device: torch.device,
                        ) -> tuple[str, str] | None:
    """Where ``hybrid``, once built, leaves the ``inductor`` candidate nothing to win.

    On a CPU the two run the same generated code between the GEMMs and convolutions, and
    differ in those: Inductor's freezing calls MKL's or oneDNN's packed kernels, while
    ``packed_linear`` and ``onednn_conv`` measured each of those against ATen's for every
    shape and ``hybrid`` calls the fastest. What ``inductor`` can still win is what it fuses
    across a GEMM's edge (a bias or activation as a oneDNN post-op): measured, it took
    1.2-2.2x hybrid's time on the ten rows of the 1-thread inference table, and at its
    closest, a Llama-style decoder's prompt step (AMD EPYC, Zen 3), 0.98x and 1.03x in two
    quiet runs: within the noise of one run's medians, where its compile is the costliest
    step of optimize (20-40 s cold there, with a copy of the weights frozen into it).
    Not so on a GPU (Triton GEMMs), under the user's Inductor settings (``max-autotune``'s
    GEMM templates), with those passes disabled, or where the user named the candidates.
    """
    if device.type != "cpu" or config.backends is not None or \
            config.backend_options.get("inductor") or \
            {"packed_linear", "onednn_conv"} & set(config.disable):
        return None
    return ("hybrid", "not built: hybrid, built and verified, runs Inductor's generated code "
                      "for the same graph with each GEMM and convolution on the kernel "
                      "measured fastest among ATen's and the MKL and oneDNN packed kernels "
                      "Inductor's freezing calls on a CPU; name backends= to measure it too")


class _Rerun:
    """One timed run of a candidate on its own copy of the inputs, and ``reset()``, which
    puts back what a run wrote into them: a decode step writes its cache and advances the
    cache's positions, so that run after run would index past the cache's end."""

    def __init__(self, run: Callable[[], Any], inputs: Any) -> None:
        self._run = run
        tensors = [x for x in pytree.tree_leaves(inputs) if isinstance(x, torch.Tensor)]
        self._saved = [(x, x.clone(), x._version) for x in tensors]

    def __call__(self) -> Any:
        return self._run()

    def reset(self) -> None:
        for tensor, value, version in self._saved:
            if tensor._version != version:
                with torch.no_grad():
                    tensor.copy_(value)
        self._saved = [(x, value, x._version) for x, value, _ in self._saved]


def _openvino_precision(gm: GraphModule, source: GraphModule, config: OptimizeConfig,
                        ) -> tuple[str, GraphModule]:
    """The precision OpenVINO runs in, and the graph it is given."""
    fp32 = full_precision(gm)
    if config.precision in openvino.HINTS and fp32 is not None:
        return config.precision, fp32
    return "fp32", source


def _expected(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The model's output on the example inputs, whose structure an ONNX file's outputs are
    put back into."""
    a, k = clone_inputs(args, kwargs)
    with torch.no_grad(), preserved(module):
        return module(*a, **k)


def _onnxruntime(source: GraphModule, module: nn.Module, args: tuple[Any, ...],
                 kwargs: dict[str, Any], device: torch.device,
                 exports: onnx_graph.Exports | None = None) -> ort.OrtGraph:
    return ort.lower(source, module.forward, args, kwargs, _expected(module, args, kwargs),
                     device, exports=exports)


def _openvino(source: GraphModule, module: nn.Module, args: tuple[Any, ...],
              kwargs: dict[str, Any], device: torch.device, precision: str = "fp32",
              exports: onnx_graph.Exports | None = None) -> ort.OrtGraph:
    return openvino.lower(source, module.forward, args, kwargs,
                          _expected(module, args, kwargs), device, precision, exports)


def identity(gm: GraphModule, source: GraphModule, args: tuple[Any, ...],
             kwargs: dict[str, Any], gradients: bool, dynamic: bool,
             settings: Any = None) -> str:
    """What the measured choice holds for: the graphs' code, the weights' shapes and dtypes,
    the inputs', the mode, the backends' settings and the ONNX Runtime and OpenVINO versions
    (the cost model adds the device, thread count and torch version)."""
    digest = hashlib.sha256()
    for graph in dict.fromkeys((gm, source)):
        digest.update(graph.code.encode())
    for name, tensor in itertools.chain(source.named_parameters(), source.named_buffers()):
        digest.update(f"{name}:{tuple(tensor.shape)}:{tensor.dtype}".encode())
    digest.update(value_spec(pytree.tree_leaves((args, kwargs))).encode())
    digest.update(repr(sorted((k, sorted(dict(v).items(), key=str))
                              for k, v in dict(settings or {}).items())).encode())
    # v2: a record names the candidates that were built, no longer those skipped up front
    # (a v1 record made while one was skipped would hide it from the choice for good).
    return f"backend|v2|{digest.hexdigest()[:32]}|grad={gradients}|dynamic={dynamic}|" \
           f"onnxruntime={ort.version()}|openvino={openvino.version()}"
