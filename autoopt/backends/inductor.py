"""TorchInductor as a backend: fused kernels generated for one optimized graph.

The graph handed over is the one from before autoopt's lowering passes (``driver.portable``):
Inductor packs weights for its own GEMMs (``freezing``), which autoopt's packed-linear and
oneDNN-convolution objects would hide from it. ``freezing`` applies to inference graphs only:
it folds the weights into the generated code as constants, which the graph's watched-weights
stamp already treats as copies (a write to a weight re-captures). A graph with gradients goes
through AOTAutograd, which partitions the joint forward/backward graph and compiles both.
"""

from __future__ import annotations

import importlib.util
import logging
import sys
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.fx import GraphModule, Node
from torch.utils import _pytree as pytree

from autoopt.backends.base import Backend, Lowering, Subgraph, WholeGraph
from autoopt.capture.graph import flat_example_inputs
from autoopt.options.config import OptimizeConfig
from autoopt.passes.graph import attr, copy_graph_module, meta_val, portable

log = logging.getLogger(__name__)


class InductorGraph:
    """A graph compiled by Inductor (on its first call), whose generated code is forgotten
    when this object is: Inductor keeps every module it loads in process-wide lists
    (``PyCodeCache``, ``sys.modules``), and with ``freezing`` those modules hold the frozen
    weights, so a candidate that lost, or a graph dropped after a weight write, would pin a
    copy of the weights for the life of the process."""

    def __init__(self, compiled: Callable[..., Any], loaded: list[Any] | None = None) -> None:
        self._compiled = compiled
        self._loaded: list[Any] = list(loaded or [])  # compiled already (``compile_fx``)
        weakref.finalize(self, _forget, self._loaded)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self._loaded:
            return self._compiled(*args, **kwargs)
        from torch._inductor.codecache import PyCodeCache

        before = len(PyCodeCache.modules)
        try:
            return self._compiled(*args, **kwargs)
        finally:  # compiled now (or a recompile for new sizes): what it loaded is ours
            self._loaded.extend(PyCodeCache.modules[before:])


def keep_backward_buffers() -> None:
    """Turn off AOTAutograd's donated buffers, for the process: a backward compiled with them
    (freed as it runs) refuses ``retain_graph=True``, so a second backward through the same
    step (several losses, a GAN's discriminator) raised where eager runs it. The flag is read
    again at each backward, not only when a graph is compiled, so it cannot be set for
    autoopt's graphs alone; it costs a compiled backward some peak memory."""
    import torch._functorch.config

    if torch._functorch.config.donated_buffer:
        log.info("inductor: AOTAutograd's donated buffers turned off, so that a compiled "
                 "backward takes retain_graph=True as eager does")
        torch._functorch.config.donated_buffer = False


def _forget(modules: list[Any]) -> None:
    try:
        from torch._inductor.codecache import PyCodeCache
    except Exception:  # noqa: BLE001 - interpreter shutdown
        return
    ids = {id(m) for m in modules}
    PyCodeCache.modules[:] = [m for m in PyCodeCache.modules if id(m) not in ids]
    for cache in (PyCodeCache.modules_no_attr, sys.modules):
        for key in [k for k, m in list(cache.items()) if id(m) in ids]:
            cache.pop(key, None)
    modules.clear()


def lower(gm: GraphModule, *, dynamic: bool, gradients: bool,
          settings: dict[str, Any] | None = None) -> InductorGraph:
    """``gm`` compiled by Inductor; compilation happens on the first call.

    A private copy of the graph module is compiled, so that dropping the result (a candidate
    that lost) also drops what Dynamo cached for it. ``settings``: the user's ``mode`` and
    ``options`` (``autoopt.backends.INDUCTOR_OPTIONS``); freezing is on for inference and
    ``fallback_random`` with gradients, unless they say otherwise.
    """
    quiet_cpp_extension()
    # With gradients, random ops (dropout) run as ATen's: the same draws as eager's from the
    # same RNG, so a training step verifies against eager (Inductor's own masks differ).
    options = {"freezing": not gradients, "fallback_random": gradients,
               **config_of(settings, dynamic)}
    if gradients:
        keep_backward_buffers()
    graph = copy_graph_module(gm)
    # Its forward, not the module: through the module's call wrapper, an error the generated
    # code raised (a token id past the vocabulary) reached the user as Dynamo's "Attempt to
    # trace generator" (the wrapper's error report, traced), not the error itself.
    return InductorGraph(torch.compile(graph.forward, backend="inductor", fullgraph=True,
                                       dynamic=dynamic, options=options))


def partial_gradients(gm: GraphModule, inputs: Sequence[Any] | None = None) -> str:
    """Why a compiled backward would differ from eager's on ``gm``, or ''.

    A compiled graph with gradients is one autograd node for all its outputs: where the loss
    reads only some outputs, autograd hands it zeros for the others, so a parameter that
    reaches only those others gets a gradient of zeros where eager leaves it None (BERT's
    pooler under a loss on the hidden states; ``torch.compile`` does the same). An optimizer
    then steps that parameter (weight decay, momentum) where eager's would skip it. So each
    trainable parameter (a ``get_attr`` tensor, or a placeholder whose example in ``inputs``
    requires grad) must reach every differentiable output or none. Reach is followed through
    floating-point values only (an integer result, ``argmax``, carries no gradient)."""
    nodes = list(gm.graph.nodes)
    output = next((n for n in reversed(nodes) if n.op == "output"), None)
    if output is None:
        return ""
    outputs: dict[Node, set[int]] = {}
    for i, leaf in enumerate(pytree.tree_leaves(output.args)):
        if isinstance(leaf, Node) and _floating(leaf):
            outputs.setdefault(leaf, set()).add(i)
    reach: dict[Node, frozenset[int]] = {}
    for node in reversed(nodes):
        found = set(outputs.get(node, ()))
        for user in node.users:
            if user.op != "output" and _floating(user) and user.target not in _NO_GRADIENT:
                found |= reach.get(user, frozenset())
        reach[node] = frozenset(found)
    sources: dict[str, frozenset[int]] = {}
    placeholders = [n for n in nodes if n.op == "placeholder"]
    for i, node in enumerate(placeholders):
        example = inputs[i] if inputs is not None and i < len(inputs) else None
        if isinstance(example, torch.Tensor) and example.requires_grad:
            sources[str(node.target)] = reach[node]
    for node in nodes:
        if node.op == "get_attr":
            value = attr(gm, node)
            if isinstance(value, torch.Tensor) and value.requires_grad:
                sources[str(node.target)] = reach[node]
    differentiable = frozenset().union(*sources.values()) if sources else frozenset()
    partial = sorted(name for name, found in sources.items()
                     if found and found != differentiable)
    if not partial:
        return ""
    return (f"with gradients, {', '.join(partial[:3])}{' …' if len(partial) > 3 else ''} "
            f"reach only some of the graph's {len(differentiable)} differentiable outputs: a "
            f"compiled backward would give them zeros where eager gives None (a loss on the "
            f"other outputs)")


def input_gradients(args: Sequence[Any], kwargs: dict[str, Any]) -> str:
    """Why a compiled backward cannot serve a call whose inputs require grad, or ''.

    Such a call's gradient is often differentiated again: a gradient penalty or a
    physics-informed loss takes ``autograd.grad(out, x, create_graph=True)`` and backpropagates
    through it. AOTAutograd's compiled backward is not differentiable ("does not currently
    support double backward"), where eager's (and the aten graph's) is."""
    if any(isinstance(t, torch.Tensor) and t.requires_grad
           for t in pytree.tree_leaves((tuple(args), kwargs))):
        return ("an input requires grad: its gradient may be differentiated again (a gradient "
                "penalty, create_graph=True), which AOTAutograd's compiled backward cannot do")
    return ""


# Calls whose floating-point result carries no gradient back to their inputs.
_NO_GRADIENT = {torch.ops.aten.detach.default, torch.Tensor.detach, "detach"}


def _floating(node: Node) -> bool:
    """Whether ``node``'s value (or any part of it) is a floating-point tensor (an unknown
    value counts as one)."""
    value = meta_val(node)
    if value is None:
        return True
    tensors = [v for v in pytree.tree_leaves(value) if isinstance(v, torch.Tensor)]
    return any(t.dtype.is_floating_point or t.dtype.is_complex for t in tensors)


def memory_estimate(gm: GraphModule, gradients: bool) -> int:
    """Bytes that compiling ``gm`` may add: with ``freezing`` (inference) Inductor may pack
    each linear's and convolution's weight for oneDNN, at most a copy of the weights (measured
    on a CPU, a 194 M-parameter decoder: 0.22× the weights at the peak, its GEMMs left to
    ATen's); a graph with gradients reads the parameters as they are."""
    from autoopt.onnx.writer import weight_bytes

    return 0 if gradients else weight_bytes(gm)


def config_of(settings: dict[str, Any] | None, dynamic: bool | None = None) -> dict[str, Any]:
    """Inductor config for the user's ``backend_options["inductor"]``: the settings its
    ``mode`` stands for, then its ``options``, which win (torch.compile takes a mode or
    options, not both, so the mode is spelled out)."""
    settings = settings or {}
    config: dict[str, Any] = {}
    if settings.get("mode") is not None:
        import torch._inductor

        for key, value in torch._inductor.list_mode_options(settings["mode"], dynamic).items():
            # Not Inductor's CUDA graphs: their replays reuse the output memory, so an output
            # the caller still holds would change under it (autoopt's own CUDA graphs, on
            # the aten backend, return fresh outputs). options= can still ask for them.
            if key != "triton.cudagraphs":
                config[key] = value
    config.update(settings.get("options") or {})
    return config


def quiet_cpp_extension() -> None:
    """Import ``torch.utils.cpp_extension`` (Inductor's CPU compiles do) without its warning
    ``No CUDA runtime is found, using CUDA_HOME=...``, which the CUDA build of torch logs on
    a machine without a GPU: noise in every autoopt run there, provoked by autoopt's compile.
    Its other records pass."""
    if "torch.utils.cpp_extension" in sys.modules:
        return  # imported already: whatever it said was said

    def no_cuda_runtime(record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("No CUDA runtime is found")

    logger = logging.getLogger("torch.utils.cpp_extension")
    logger.addFilter(no_cuda_runtime)
    try:
        import torch.utils.cpp_extension  # noqa: F401
    finally:
        logger.removeFilter(no_cuda_runtime)


def available() -> str:
    """Why Inductor cannot run here, or ''. Looked up, not imported (importing it takes ~3 s,
    spent for nothing where a cached choice builds another backend); an import that fails
    when the lowering is built skips the candidate with its reason."""
    try:
        found = importlib.util.find_spec("torch._inductor.compile_fx") is not None
    except Exception as exc:  # noqa: BLE001 - any lookup failure means: not here
        return f"Inductor cannot be found ({type(exc).__name__}: {exc})"
    return "" if found else "Inductor is not part of this PyTorch build"


class Inductor(Backend):
    name = "inductor"

    def whole_graph(self, graph: WholeGraph) -> Lowering | str:
        source = graph.source
        why = available() or (
            "memory_budget's plan (recompute, offload) is applied to the aten graph, and "
            "Inductor would plan saved activations its own way" if graph.memory_plan else
            partial_gradients(source, [] if graph.adapt is not None else
                              flat_example_inputs(source, graph.args, graph.kwargs))
            or input_gradients(graph.args, graph.kwargs) if graph.gradients else "")
        if why:
            return why
        return Lowering(self.name, lambda: graph.warm(graph.call(lower(
            source, dynamic=graph.dynamic, gradients=graph.gradients,
            settings=graph.settings(self.name)))),
            memory=memory_estimate(source, graph.gradients),
            dominated_by=dominated(graph.config, graph.device))

    def subgraph(self, graph: Subgraph) -> Lowering | str:
        why = available() or (
            partial_gradients(graph.optimized, graph.inputs) if graph.gradients else "")
        if why:
            return why
        return Lowering(self.name, lambda: lower_subgraph(
            graph.optimized, graph.example_inputs, dict(graph.config.backend_options.get(
                self.name, {}))),
            memory=memory_estimate(portable(graph.optimized), graph.gradients))


BACKEND = Inductor()


def lower_subgraph(optimized: GraphModule, example_inputs: Sequence[Any],
                   settings: dict[str, Any]) -> Callable[..., Any]:
    """A Dynamo subgraph lowered exactly as ``torch.compile``'s default backend lowers it
    (``compile_fx``, inside Dynamo's tracing context)."""
    from torch._inductor import config as inductor_config
    from torch._inductor.compile_fx import compile_fx

    # A copy: Inductor rewrites the graph module it is given.
    with inductor_config.patch(config_of(settings)):
        return compile_fx(copy_graph_module(portable(optimized)), list(example_inputs))


def dominated(config: OptimizeConfig, device: torch.device,
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
