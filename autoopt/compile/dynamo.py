"""autoopt as a ``torch.compile`` backend: ``torch.compile(model, backend="autoopt")``.

Dynamo captures what it can (guarding shapes, flags, Python state, hooks) and hands each
captured subgraph here; the pass pipeline runs on it, checked against the subgraph as Dynamo
gave it. This is also how ``optimize`` handles models no whole-graph capture can take.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch.fx import GraphModule

from autoopt.backends.subgraph import lower_subgraph
from autoopt.capture.graph import annotate, concrete_inputs
from autoopt.check.compare import VerifyResult, check_all, reference_run
from autoopt.check.inputs import clone_inputs, input_sets
from autoopt.check.report import CaptureRecord, PassRecord
from autoopt.check.state import preserved
from autoopt.compile.pass_runner import run_pipeline
from autoopt.cost_model import CostModel
from autoopt.options.config import OptimizeConfig
from autoopt.passes import PassContext
from autoopt.passes.graph import copy_graph_module, written_placeholders, written_tensors


def autoopt_backend(gm: GraphModule, example_inputs: Sequence[Any], *,
                    config: OptimizeConfig | None = None,
                    record: CaptureRecord | None = None,
                    options: Mapping[str, Any] | None = None, **extra: Any) -> Callable[..., Any]:
    """Optimize one Dynamo subgraph and return the callable Dynamo will run.

    Args:
        gm: the subgraph, at torch-function level, parameters as inputs.
        example_inputs: its example inputs: real tensors, and a ``SymInt`` for each size
            Dynamo made dynamic.
        config: autoopt options.
        record: where to add this subgraph's pass records (``optimize`` passes one).
        options: ``OptimizeConfig`` fields merged into ``config``, as ``torch.compile(model,
            backend="autoopt", options={"disable": ["remove_noops"]})`` passes them.
    """
    overrides = {**(options or {}), **extra}
    if overrides or config is None:
        config = OptimizeConfig.build(config, overrides)
    start = time.perf_counter()
    annotate(gm, list(example_inputs))
    reference = copy_graph_module(gm)
    # Passes and verification run the graph on real tensors, which take sizes, not symbols.
    inputs = concrete_inputs(list(example_inputs))

    def check(candidate: GraphModule) -> VerifyResult:
        return verify_graph(reference, candidate, inputs, config)

    tensors = [x for x in inputs if isinstance(x, torch.Tensor)]
    device = tensors[0].device if tensors else torch.device("cpu")
    ctx = PassContext(tuple(inputs), device, training=torch.is_grad_enabled() and any(
        t.requires_grad for t in tensors), cost=CostModel(device),
        options=config.resolved_pass_options)
    optimized, records = run_pipeline(gm, config.passes, ctx, check if config.verify else None,
                                      disabled=config.disabled_passes, debug=config.debug)
    label = f"subgraph {record.subgraphs + 1}" if record is not None else "subgraph"
    run, choice = lower_subgraph(optimized, example_inputs, inputs, label=label, config=config,
                                 cost_model=ctx.cost, verify=check if config.verify else None,
                                 gradients=ctx.training)
    if record is not None:
        record.subgraphs += 1
        record.nodes_before += len(reference.graph.nodes)
        record.nodes_after += len(optimized.graph.nodes)
        _merge(record, records)
        record.backends.append(choice)
        record.seconds += time.perf_counter() - start
    return run


def verify_graph(reference: GraphModule, candidate: GraphModule, example_inputs: list[Any],
                 config: OptimizeConfig) -> VerifyResult:
    """Compare two graphs taking the same flat inputs: outputs, and what they write to inputs.

    Each run gets its own clone of every non-parameter tensor input, so in-place updates
    (BatchNorm statistics) are compared rather than leaked into the caller's tensors. A
    random input set the reference graph itself rejects (an index out of range: a subgraph's
    inputs can be positions or lengths only some values of which are valid) is replaced by
    another draw or left out, as the result's ``note`` says; the candidate raising where the
    reference did not is a mismatch.
    """
    # A library's own kernels (torchvision's roi_align, a user's custom op) may index memory
    # with their inputs unchecked: a random box's batch index read out of bounds crashed the
    # process. Graphs calling one are checked on the example inputs, which eager ran.
    random = 0 if _custom_ops(reference) else config.random_inputs
    sets = input_sets(tuple(example_inputs), {}, random)
    graphs = [g for g in (reference, candidate) if isinstance(g, GraphModule)]
    writes = set().union(*(written_placeholders(g) for g in graphs))
    # What each writes through attributes (an optimizer's parameters): put back after a run.
    attributes = {id(g): written_tensors(g) for g in graphs}

    def run(graph: GraphModule, args: tuple[Any, ...]) -> tuple[Any, list[Any]]:
        private, _ = clone_inputs(args, {}, writes)
        with torch.random.fork_rng(), preserved(attributes.get(id(graph), [])):
            torch.manual_seed(0)
            # Its forward, not the module: a graph module's call prints the generated code's
            # traceback to stderr before raising, and a candidate failing on a random input
            # set is an expected outcome here, not the user's error.
            out = (graph.forward if isinstance(graph, GraphModule) else graph)(*private)
        written = [x for x, original in zip(private, args, strict=True)
                   if isinstance(x, torch.Tensor) and x is not original]
        return out, written

    def run_pair(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any]:
        with reference_run():
            expected = run(reference, args)
        return expected, run(candidate, args)

    return check_all(run_pair, sets, config.verification_tolerances)


def _custom_ops(gm: GraphModule) -> bool:
    """Whether ``gm`` calls an op outside PyTorch's own namespaces."""
    return any(isinstance(n.target, torch._ops.OpOverload | torch._ops.OpOverloadPacket)
               and _namespace(n.target) not in _TORCH_NAMESPACES
               for n in gm.graph.nodes if n.op == "call_function")


def _namespace(op: Any) -> str:
    return getattr(op, "namespace", None) or str(getattr(op, "_qualified_op_name", "")).split(
        "::")[0]


_TORCH_NAMESPACES = frozenset({"aten", "prims", "_c10d_functional", "c10d_functional",
                               "quantized", "mkldnn", "mkl"})


def _merge(record: CaptureRecord, records: list[PassRecord]) -> None:
    by_name = {r.name: r for r in record.passes}
    for r in records:
        seen = by_name.get(r.name)
        if seen is None:
            copy = PassRecord(r.name, r.status, dict(r.counts), r.seconds, r.reason)
            record.passes.append(copy)
            by_name[r.name] = copy
            continue
        seen.seconds += r.seconds
        for k, v in r.counts.items():
            if r.status == "applied":
                seen.counts[k] = seen.counts.get(k, 0) + v
        # A rollback in any subgraph is what the user needs to see.
        if r.status in ("rolled_back", "failed") or seen.status in ("unchanged", "disabled"):
            seen.status, seen.reason = r.status, r.reason or seen.reason
