"""Planning a pipeline: each device's figures, the cut from measured node costs corrected by
timing whole stages, and ``optimize``'s hook that builds and checks a pipeline for
``devices=``."""

from __future__ import annotations

import dataclasses
import logging
import statistics
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch.fx import GraphModule
from torch.utils import _pytree as pytree

from autoopt.check.compare import compare
from autoopt.check.state import preserved
from autoopt.cost_model import CostModel, GraphCost, NodeCost
from autoopt.errors import ConfigError, ModelError
from autoopt.parallel.microbatches import split_microbatches
from autoopt.parallel.partition import DeviceSpec, Partition, PartitionError, partition
from autoopt.parallel.pipeline import Pipeline, pipeline_from_graph
from autoopt.parallel.stages import emit_stages
from autoopt.passes.graph import portable, written_attributes

if TYPE_CHECKING:
    from autoopt.module.optimized import OptimizedModule

log = logging.getLogger(__name__)


def device_specs(devices: Sequence[str], memory_bytes: int | None = None,
                 speeds: Sequence[float] | None = None) -> list[DeviceSpec]:
    """``DeviceSpec`` per device name: the same memory cap for all, relative speeds (default
    1.0: the devices are the kind the costs were measured on)."""
    speeds = list(speeds) if speeds is not None else [1.0] * len(devices)
    if len(speeds) != len(devices):
        raise ConfigError(f"speeds has {len(speeds)} entries for {len(devices)} devices")
    return [DeviceSpec(str(d), float(v), memory_bytes) for d, v in zip(devices, speeds,
                                                                       strict=True)]


def measured_device_specs(devices: Sequence[str], cost_model: CostModel,
                          memory_bytes: int | None = None) -> list[DeviceSpec]:
    """``DeviceSpec`` per device with measured figures: speed relative to the cost model's
    device (matmul throughput; 1.0 for a device of the same kind), and the link a stage
    receives over (memory bandwidth on a CPU, the host link on a GPU)."""
    home = cost_model.info.ceilings
    specs = []
    for name in devices:
        device = torch.device(name)
        same_kind = device.type == cost_model.device.type
        info = cost_model.info if same_kind else CostModel(device, cost_model.cache).info
        ceilings = info.ceilings
        assert home is not None and ceilings is not None  # info measures them
        speed = 1.0 if same_kind else ceilings.matmul_flops / home.matmul_flops
        link = (ceilings.memory_bandwidth if device.type == "cpu" else
                info.link_bandwidth or ceilings.host_link_bandwidth or 10e9)
        specs.append(DeviceSpec(name, speed, memory_bytes, link))
    return specs


def plan_stages(gm: GraphModule, inputs: Sequence[Any], devices: Sequence[DeviceSpec], *,
                cost_model: CostModel | None = None, microbatches: int = 1,
                training: bool = False, measure: bool = True,
                refine: bool = True) -> Partition:
    """Profile ``gm`` on ``inputs`` (or estimate, without ``measure``) and partition it;
    with ``measure`` and ``refine``, correct the cut by measured stage times
    (``refine_by_measurement``). A partition that cannot exist is a ``ConfigError`` naming
    the reason."""
    cost_model = cost_model or CostModel("cpu")
    # gm holds the model's own parameters and buffers (under ``distributed_pipeline``, the
    # caller's model), and the inputs are views of the caller's example: the profiling and
    # stage-timing runs below must change neither (BatchNorm statistics, counters, in-place
    # writes), on this rank or in the stages built from gm afterwards.
    with preserved(gm, list(inputs)):
        cost = (cost_model.profile(gm, list(inputs), training=training, in_model=True)
                if measure else cost_model.predict(gm))
        try:
            plan = partition(gm, cost, devices, microbatches=microbatches, training=training)
            if measure and refine and len(devices) > 1:
                plan = refine_by_measurement(gm, cost, devices, inputs, plan, cost_model,
                                             microbatches=microbatches, training=training)
            return plan
        except PartitionError as exc:
            raise ConfigError(str(exc)) from exc


def stage_seconds(gm: GraphModule, plan: Partition, inputs: Sequence[Any],
                  cost_model: CostModel, repeats: int = 5) -> list[float]:
    """Measured seconds of each stage of ``plan``, each run whole on its real inputs (the
    previous stages' outputs), on the cost model's device."""
    values = list(inputs)
    seconds = []
    with torch.no_grad(), preserved(gm, values):
        for stage in emit_stages(gm, plan):
            seconds.append(cost_model.measure(stage, values, repeats=repeats))
            values = list(stage(*values))
    return seconds


def _scaled(cost: NodeCost, factor: float) -> NodeCost:
    in_model = cost.in_model_s * factor if cost.in_model_s is not None else None
    return dataclasses.replace(cost, latency_s=cost.latency_s * factor, in_model_s=in_model)


def refine_by_measurement(gm: GraphModule, cost: GraphCost, devices: Sequence[DeviceSpec],
                          inputs: Sequence[Any], plan: Partition, cost_model: CostModel, *,
                          rounds: int = 2, trials: int = 3, microbatches: int = 1,
                          training: bool = False) -> Partition:
    """Correct node costs by measured stage times, cut again, and return the cut whose
    measured bottleneck is smallest.

    Nodes timed alone miss what a stage's nodes do to each other (caches, memory traffic);
    a stage run whole includes it. Each of ``rounds`` scales every node by its stage's
    measured / predicted time and partitions the corrected costs again. The candidate cuts
    are then timed against each other in ``trials`` interleaved rounds (one noisy
    measurement must not pick the winner) and the median decides.
    """
    candidates = [plan]
    for _ in range(rounds):
        measured = stage_seconds(gm, plan, inputs, cost_model)
        scale = {}
        for m, d, stage in zip(measured, devices, plan.stages, strict=True):
            predicted = stage.compute_s * d.speed  # on the device the costs describe
            for name in stage.nodes:
                scale[name] = m / predicted if predicted > 0 else 1.0
        nodes = tuple(_scaled(c, scale.get(c.node, 1.0)) for c in cost.nodes)
        cost = dataclasses.replace(cost, nodes=nodes, latency_s=sum(c.latency_s for c in nodes),
                                   by_node={c.node: c for c in nodes})
        plan = partition(gm, cost, devices, microbatches=microbatches, training=training)
        if all(plan.cuts != c.cuts for c in candidates):
            candidates.append(plan)
    if len(candidates) == 1:
        return candidates[0]
    samples: list[list[float]] = [[] for _ in candidates]
    for _ in range(trials):
        for i, candidate in enumerate(candidates):
            measured = stage_seconds(gm, candidate, inputs, cost_model, repeats=3)
            samples[i].append(max(m / d.speed + s.transfer_s for m, d, s in
                                  zip(measured, devices, candidate.stages, strict=True)))
    medians = [statistics.median(s) for s in samples]
    log.info("candidate cuts %s: measured bottlenecks %s ms", [c.cuts for c in candidates],
             [round(m * 1e3, 3) for m in medians])
    return candidates[medians.index(min(medians))]


# --- building a pipeline from a model --------------------------------------------------------


def pipeline_module(optimized: OptimizedModule, args: tuple[Any, ...], kwargs: dict[str, Any],
                    training: bool) -> Pipeline:
    """``optimize``'s hook for ``devices=``: capture and optimize at the microbatch's shapes,
    partition into one stage per device, check the pipeline against eager on the example
    inputs, and return it (with the optimizer's ``report``)."""
    config = optimized.config
    devices = list(config.devices or ())
    micro_flat = split_microbatches(pytree.tree_leaves((args, kwargs)), config.microbatches)[0]
    spec = pytree.tree_structure((args, kwargs))
    micro_args, micro_kwargs = pytree.tree_unflatten(micro_flat, spec)
    with torch.no_grad() if not training else torch.enable_grad():
        spec_run = optimized.specialize(micro_args, micro_kwargs)
    gm = spec_run.graph
    if spec_run.method != "export" or not isinstance(gm, GraphModule):
        raise ModelError(f"pipelining needs the whole model as one graph (torch.export), but "
                         f"it was captured by {spec_run.method}; see the report's capture "
                         f"attempts:\n{optimized.report}")
    written = written_attributes(gm)
    if config.microbatches > 1 and written and not training:
        # Each microbatch's stage run would write them: a counter moved by the number of
        # microbatches per call, a running mean took each microbatch's (the outputs alike).
        raise ConfigError(f"the forward writes {', '.join(written[:4])}"
                          f"{' …' if len(written) > 4 else ''} on every call; a pipeline over "
                          f"{config.microbatches} microbatches would write them once per "
                          f"microbatch. Use microbatches=1.")
    if any(torch.device(d).type != optimized.cost_model.device.type for d in devices):
        # Lowered kernels (oneDNN's packed convolutions) run only on the capture's device
        # type; stages elsewhere get the graph from before lowering.
        gm = portable(gm)
    flat = pytree.tree_leaves((micro_args, micro_kwargs))
    specs = measured_device_specs(devices, optimized.cost_model)
    plan = plan_stages(gm, flat, specs, cost_model=optimized.cost_model,
                       microbatches=config.microbatches, training=training)
    pipe = pipeline_from_graph(gm, plan, config.microbatches)
    pipe.inference_only = not training
    pipe.train(training)  # it stands for the model: its flag is the mode its graphs run
    pipe.captured_training = training
    pipe.report = optimized.report
    if config.verify:
        # Both runs start from the caller's inputs as given (a forward may write them in
        # place), and neither leaves a trace on them, the model or the stages.
        with torch.no_grad(), preserved(optimized.module, pipe, args, kwargs):
            torch.manual_seed(0)
            # The stages may read the module's own buffers: eager's writes (a counter) are
            # put back before the pipeline runs from the same start.
            with preserved(args, kwargs, optimized.module):
                expected = optimized.module(*args, **kwargs)
            torch.manual_seed(0)
            result = compare(expected, pipe(*args, **kwargs), config.verification_tolerances)
        if not result.ok and config.microbatches == 1:
            raise ModelError(f"the pipeline differs from eager ({result.detail}); "
                             f"verify=False accepts it")
        if not result.ok:
            raise ModelError(f"the pipeline over {config.microbatches} microbatches differs "
                             f"from eager ({result.detail}): the model's function depends on "
                             f"how the batch is split (BatchNorm batch statistics or dropout "
                             f"masks in training). Use microbatches=1, or verify=False to "
                             f"accept it.")
    log.info("pipeline over %s:\n%s", devices, plan.table())
    return pipe
