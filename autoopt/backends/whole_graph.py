"""The backend for one captured whole graph (``torch.export`` or ``symbolic_trace``).

``lower_whole_graph`` offers the graph to each backend the user allows (``aten`` is the pass
runner's verified result; Inductor, ONNX Runtime and OpenVINO lower the graph from before
autoopt's own lowerings), collects the candidates and why the others do not apply, and lets
``choose_backend`` verify and measure them.
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

from autoopt.backends import offers, openvino, static_int8
from autoopt.backends import onnxruntime as ort
from autoopt.backends.base import WholeGraph
from autoopt.backends.choice import NoBackend, choose_backend
from autoopt.backends.prediction import GraphKind, Predictor
from autoopt.check.compare import VerifyResult
from autoopt.check.inputs import clone_inputs
from autoopt.check.report import BackendChoice
from autoopt.check.state import preserved
from autoopt.cost_model import CostModel, GraphCost
from autoopt.cost_model.estimate import value_spec
from autoopt.cost_model.isolation import written_placeholders
from autoopt.options.config import OptimizeConfig
from autoopt.passes.graph import portable, release_packed, restore_packed


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
    # The aten lowering's packed weights (hybrid calls the same kernels) can be dropped while
    # a backend with its own copies is built, and packed again if aten or hybrid stays fastest.
    graph = WholeGraph(gm, portable(gm), aten, module, args, kwargs, config, device, adapt,
                       gradients, dynamic, memory_plan,
                       packed={"release": functools.partial(release_packed, gm),
                               "restore": functools.partial(restore_packed, gm)},
                       cost_model=cost_model)
    names = config.candidate_backends
    # A call with gradients (an eval model called outside no_grad) gets a graph that keeps
    # them, in fp32 as under dynamic int8: int8 kernels have no backward.
    static = config.calibration is not None and not gradients
    if static:  # int8 with calibration runs on the engines that quantize with it, or nowhere
        names = tuple(n for n in names if n in static_int8.ENGINES)  # one, by the config
    lowerings, skipped = offers(names, "whole_graph", graph)
    if static:
        skipped.update({n: static_int8.declined(n) for n in config.candidate_backends
                        if n not in names})

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

    what = identity(gm, graph.source, args, kwargs, gradients, dynamic, config.backend_options)
    if static:
        what += f"|static-int8|{config.calibration.fingerprint()}"
    # Inference graphs of static sizes, the ones engines beyond aten and Inductor take (an
    # estimate of a dynamic graph's nodes would read its symbolic sizes).
    predicted = not (static or config.backend is not None or gradients or dynamic)
    # One estimate of the source's nodes, for the floor and the graph's kind, made only where
    # candidates are measured (a recorded choice needs neither).
    estimate = functools.cache(functools.partial(cost_model.predict, graph.source))
    with graph.exports:
        try:
            run, choice = choose_backend(
                "whole graph", lowerings, skipped, verify=verify, timer=timer,
                cost_model=cost_model, what=what, required=config.backend is not None,
                gradients=gradients, state=[module], reference=module,
                floor_s=functools.partial(floor_seconds, cost_model, graph.source,
                                          config.precision, gradients, estimate=estimate),
                predictor=Predictor(cost_model, functools.partial(
                    GraphKind.of, cost_model, graph.source, precision=config.precision,
                    gradients=gradients, dynamic=dynamic, graph=what, estimate=estimate))
                if predicted else None)
        except NoBackend as exc:
            if not static:
                raise
            reasons = {n: why for n, why in exc.skipped.items() if n in static_int8.ENGINES}
            raise static_int8.refusal(graph.source, config.calibration, args, kwargs,
                                      config.precision_tolerance, reasons) from None
    if static:
        _unseen(run, module, config, args, kwargs, choice)
    return run, choice


def _unseen(run: Callable[..., Any], module: nn.Module, config: OptimizeConfig,
            args: tuple[Any, ...], kwargs: dict[str, Any], choice: BackendChoice) -> None:
    """The chosen int8 engine's error on inputs calibration never saw (the example inputs and
    the batches held out), and a classifier's top-1 agreement with fp32 on those batches, in
    the choice's report line."""
    summary = getattr(run, "int8", None)
    if summary is None:
        return
    held = config.calibration.like(args, kwargs).held_out
    with preserved(module):
        summary.error, summary.agreement = static_int8.unseen(
            run, module, [clone_inputs(args, kwargs), *held])
    choice.regions = summary.describe(config.precision_tolerance)


def floor_seconds(cost_model: CostModel, source: GraphModule, precision: str | None,
                  gradients: bool, *, estimate: Callable[[], GraphCost] | None = None,
                  ) -> float | None:
    """The least a call of ``source`` can take at this machine's measured peak: its FLOPs
    (the forward's; a backward adds about twice as many) at the matmul peak of its precision
    (fp32's; reduced precisions' at twice the bf16 or fp16 peak, for int8's matrix units),
    less a fifth for the peak's own measurement error. A time below it was taken while the
    clock was not the candidate's alone. None where the peak or the FLOPs are not known.
    ``estimate``: gives ``cost_model.predict(source)``, where the caller shares it."""
    try:
        ceilings = cost_model.info.ceilings
        if ceilings is None:
            return None
        costs = estimate() if estimate is not None else cost_model.predict(source)
        flops = sum(cost.flops for cost in costs.nodes)
    except Exception:  # noqa: BLE001 - a bound the choice can do without
        return None
    exact = precision in (None, "fp32") and cost_model.device.type == "cpu"
    peak = ceilings.matmul_flops if exact else 2 * max(ceilings.matmul_flops,
                                                       ceilings.half_matmul_flops)
    flops *= 3 if gradients else 1
    return 0.8 * flops / peak if flops > 0 and peak > 0 else None


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
