"""autoopt's pipeline cut, run across processes by ``torch.distributed.pipelining``.

Every process captures the same graph; rank 0 profiles it and partitions it into one stage per
process, and sends the plan to the others; each process then builds its own stage as a
``PipelineStage`` and runs it under ``ScheduleGPipe`` (inference, training) or
``Schedule1F1B`` (training)::

    torchrun --nproc-per-node 2 examples/pipeline_torchrun.py

Example:
    >>> dist.init_process_group("gloo")
    >>> pipe = autoopt.parallel.distributed.distributed_pipeline(model, (x,), microbatches=4)
    >>> out = pipe.step(x)   # the model's output on the last rank, None elsewhere

A weight that stages on several ranks read (an embedding tied to the LM head) is copied to each;
a training ``step`` all-reduces its gradient between those ranks (``DistributedPipeline.tied``),
so the copies, stepped by identical optimizers, stay one weight.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import logging
import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
from torch.fx import GraphModule, Node
from torch.fx._pytree import tree_flatten_spec
from torch.utils import _pytree as pytree

from autoopt.capture.graph import export_graph
from autoopt.cost_model import CostModel
from autoopt.errors import ConfigError
from autoopt.parallel.microbatches import check_mergeable_outputs, split_microbatches
from autoopt.parallel.partition import Partition
from autoopt.parallel.planning import device_specs, plan_stages
from autoopt.parallel.stages import emit_stages, place_stage, shared_parameters, traced_values

log = logging.getLogger(__name__)

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}


@dataclass(frozen=True)
class TiedParameter:
    """A parameter that several stages read (an embedding tied to the LM head): each of their
    ranks holds a copy, and ``DistributedPipeline.step`` sums the copies' gradients.

    Args:
        name: its name in this rank's stage.
        ranks: the ranks (in ``group``'s numbering) whose stages hold it.
        group: the process group of those ranks.
    """

    name: str
    ranks: tuple[int, ...]
    group: dist.ProcessGroup | None


@dataclass
class DistributedPipeline:
    """This process's stage of a pipeline and the schedule that runs it.

    Args:
        stage: the ``PipelineStage`` this rank runs.
        module: its ``GraphModule`` (parameters named as in the original model; give them to
            this rank's optimizer).
        schedule: the ``torch.distributed.pipelining`` schedule.
        plan: the partition every rank shares.
        tied: this stage's parameters that other ranks' stages hold too; each training
            ``step`` all-reduces their gradients, so the copies stay one weight.
    """

    stage: PipelineStage
    module: GraphModule
    schedule: Any
    plan: Partition
    in_spec: pytree.TreeSpec | None
    out_spec: pytree.TreeSpec | None
    tied: tuple[TiedParameter, ...] = ()

    @property
    def is_first(self) -> bool:
        return self.stage.is_first

    @property
    def is_last(self) -> bool:
        return self.stage.is_last

    def step(self, *args: Any, target: torch.Tensor | None = None, **kwargs: Any) -> Any:
        """Run one step over the microbatches: inputs on the first rank, ``target`` on the last
        (training). Returns the merged output on the last rank (in the model's own structure),
        None on the others. In training, the gradients of weights tied across ranks (``tied``)
        are summed between those ranks before it returns, ready for the optimizer step."""
        flat: list[Any] = []
        if self.is_first:
            flat = (list(tree_flatten_spec((tuple(args), dict(kwargs)), self.in_spec))
                    if self.in_spec is not None else list(args))
            flat = [x.to(self.stage.device) if isinstance(x, torch.Tensor) else x for x in flat]
        # Every rank of a training pipeline runs backward in each step, with a target or not
        # (only the last needs one), so every rank holding a tied weight reaches the all-reduce.
        with self._summing_tied_gradients():
            out = self.schedule.step(*flat, **({"target": target} if target is not None else {}))
        if not self.is_last or out is None:
            return None
        return _structured(out, self.out_spec)

    @contextlib.contextmanager
    def _summing_tied_gradients(self) -> Iterator[None]:
        """Around a training step: afterwards each tied parameter's gradient holds what every
        rank holding it computed in this step (all-reduced, before the caller's optimizer
        step), plus what it held before. Only this step's part is reduced, so gradients
        accumulated over several steps are not summed twice."""
        params = [self.module.get_parameter(t.name) for t in self.tied]
        earlier = [p.grad for p in params]
        for p in params:
            p.grad = None
        try:
            yield
        except BaseException:
            # No all-reduce: the other ranks may never reach it. The failed step's partial
            # gradients are dropped and the earlier ones put back.
            for p, before in zip(params, earlier, strict=True):
                p.grad = before
            raise
        for tie, p, before in zip(self.tied, params, earlier, strict=True):
            grad = p.grad if p.grad is not None else torch.zeros_like(p)
            dist.all_reduce(grad, group=tie.group)
            p.grad = grad if before is None else before + grad


def distributed_pipeline(model: nn.Module, example_inputs: tuple[Any, ...],
                         example_kwargs: Mapping[str, Any] | None = None, *,
                         microbatches: int = 1, device: str | torch.device | None = None,
                         training: bool = False, schedule: str = "gpipe",
                         loss_fn: Callable[[Any, torch.Tensor], torch.Tensor] | None = None,
                         memory_bytes: int | None = None,
                         group: dist.ProcessGroup | None = None) -> DistributedPipeline:
    """Build this process's stage of ``model``'s pipeline (call on every rank, same model and
    example shapes).

    Args:
        model: the model; every rank holds the same weights (same seed or checkpoint).
        example_inputs, example_kwargs: a full batch (split into ``microbatches``).
        microbatches: microbatches per step.
        device: this rank's device (default: ``cuda:LOCAL_RANK`` with CUDA, else ``cpu``).
        training: build for ``step(..., target=)`` with ``loss_fn``.
        schedule: ``gpipe`` or ``1f1b``.
        loss_fn: ``loss_fn(output, target)`` per microbatch, on the last rank; the output has
            the model's own structure. Gradients are scaled by 1 / microbatches (as for a
            mean-reduced loss).
        memory_bytes: each device's memory cap for the partition.
        group: the process group (default: the world).
    """
    if schedule not in SCHEDULES:
        raise ConfigError(f"schedule must be one of {sorted(SCHEDULES)}; got {schedule!r}")
    if training and loss_fn is None:
        raise ConfigError("training needs loss_fn(output, target) to start each backward")
    if not dist.is_initialized():
        raise ConfigError("torch.distributed is not initialised; start the script with torchrun "
                          "and call dist.init_process_group() first.")
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    target = torch.device(device) if device is not None else _default_device()
    if target.type == "cuda":
        torch.cuda.set_device(target)  # NCCL collectives run on the current device
    kwargs = dict(example_kwargs or {})
    micro = split_microbatches(pytree.tree_leaves((tuple(example_inputs), kwargs)),
                               microbatches)[0]
    micro_args, micro_kwargs = pytree.tree_unflatten(
        micro, pytree.tree_structure((tuple(example_inputs), kwargs)))
    with torch.enable_grad() if training else torch.no_grad():
        gm = export_graph(model, micro_args, micro_kwargs)
    gm.graph.eliminate_dead_code()
    gm.recompile()
    box: list[Any] = [None]
    if rank == 0:  # one rank measures, so every rank cuts the same way
        flat = pytree.tree_leaves((micro_args, micro_kwargs))
        box[0] = plan_stages(gm, flat, device_specs([str(target)] * world, memory_bytes),
                             cost_model=CostModel(_model_device(model)),
                             microbatches=microbatches,
                             training=training)
        log.info("pipeline plan:\n%s", box[0].table())
    dist.broadcast_object_list(box, src=0, group=group)
    plan: Partition = box[0]
    info = getattr(gm.graph._codegen, "pytree_info", None)
    out_spec = info.out_spec if info else None
    check_mergeable_outputs(traced_values(gm, "placeholder"), traced_values(gm, "output"),
                            microbatches, out_spec)
    stages = emit_stages(gm, plan)
    # A copy: moving it or training it leaves the caller's model as it was.
    module = place_stage(_contiguous_boundaries(copy.deepcopy(stages[rank])), target)
    tied = _tie(stages, rank, group) if training else ()
    stage = PipelineStage(module, rank, world, target, group=group)
    loss = None if loss_fn is None else functools.partial(_structured_loss, loss_fn, out_spec)
    runner = SCHEDULES[schedule](stage, microbatches, loss_fn=loss)
    return DistributedPipeline(stage, module, runner, plan, info.in_spec if info else None,
                               out_spec, tied)


def _tie(stages: list[GraphModule], rank: int,
         group: dist.ProcessGroup | None) -> tuple[TiedParameter, ...]:
    """This rank's parameters that other ranks' stages hold too, each with a process group of
    the ranks holding it.

    A cut can fall between two users of one parameter (an embedding and the LM head tied to
    it are at the two ends of the graph, so every cut does); each rank then trains its own
    copy unless their gradients are summed. Every rank walks the same list in the same
    order, so the groups are created alike; only the ranks in a group create it.
    """
    world = dist.get_world_size(group)
    groups: dict[tuple[int, ...], dist.ProcessGroup | None] = {}
    tied = []
    for name, ranks in shared_parameters(stages):
        if rank not in ranks or not stages[ranks[0]].get_parameter(name).requires_grad:
            continue
        if ranks not in groups:
            groups[ranks] = group if len(ranks) == world else dist.new_group(
                [r if group is None else dist.get_global_rank(group, r) for r in ranks],
                use_local_synchronization=True)
        own = next(n for n, p in stages[rank].named_parameters(remove_duplicate=False)
                   if p is stages[ranks[0]].get_parameter(name))
        tied.append(TiedParameter(own, ranks, groups[ranks]))
    if tied:
        log.info("rank %d: gradients of %s are summed with ranks holding the same weights",
                 rank, ", ".join(f"{t.name} (ranks {list(t.ranks)})" for t in tied))
    return tuple(tied)


def _dense(value: Any) -> Any:
    """``value`` in contiguous memory if it is a tensor (no copy when it already is)."""
    return value.contiguous() if isinstance(value, torch.Tensor) else value


class _DenseGrad(torch.autograd.Function):
    """The identity, whose gradient leaves contiguous."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()


def _dense_grad(value: Any) -> Any:
    """``value`` unchanged; in backward, its gradient made contiguous."""
    if isinstance(value, torch.Tensor) and value.is_floating_point():
        return _DenseGrad.apply(value)
    return value


def _contiguous_boundaries(stage: GraphModule) -> GraphModule:
    """The stage with what crosses its boundaries made contiguous: point-to-point sends and
    receives need dense buffers (gloo refuses others: "input tensor has to be contiguous").

    - Outputs (sent forward): a cut may fall after a view (an expanded mask, a transpose), and
      a node a pass added may carry no metadata to say so, so every output goes through
      ``_dense``.
    - Gradients of the inputs (sent backward, and the next-earlier stage sizes its receive
      buffers from their strides): autograd's can be strided (the gradient of an attention
      output that the next op transposes, measured on GPT-2), so every input goes through
      ``_dense_grad``.
    """
    graph = stage.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    if placeholders:
        with graph.inserting_after(placeholders[-1]):
            for ph in placeholders:
                dense = graph.call_function(_dense_grad, (ph,))
                dense.meta = dict(ph.meta)
                ph.replace_all_uses_with(dense, delete_user_cb=lambda user, d=dense: user is not d)
    output = next(n for n in graph.nodes if n.op == "output")
    values = list(output.args[0])
    for i, value in enumerate(values):
        if not isinstance(value, Node):
            continue
        meta = value.meta.get("val")
        with graph.inserting_before(output):
            values[i] = graph.call_function(_dense, (value,))
        if isinstance(meta, torch.Tensor):
            values[i].meta["val"] = meta.contiguous()
    output.args = (tuple(values),)
    stage.recompile()
    return stage


def _structured_loss(loss_fn: Callable[[Any, torch.Tensor], torch.Tensor],
                     out_spec: pytree.TreeSpec | None, output: Any,
                     labels: torch.Tensor) -> torch.Tensor:
    return loss_fn(_structured(output, out_spec), labels)


def _structured(output: Any, out_spec: pytree.TreeSpec | None) -> Any:
    flat = list(output) if isinstance(output, (tuple, list)) else [output]
    return pytree.tree_unflatten(flat, out_spec) if out_spec is not None else tuple(flat)


def _model_device(model: nn.Module) -> torch.device:
    """Where the costs are measured: where the model's weights are, as captured."""
    return next((p.device for p in model.parameters()), torch.device("cpu"))


def _default_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")
