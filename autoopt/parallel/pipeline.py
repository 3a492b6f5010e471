"""Pipeline stages from a partition, and a local runtime that runs them over microbatches.

    x ─ [stage 0 on dev 0] ─ boundary ─ [stage 1 on dev 1] ─ ... ─ y

``emit_stages`` turns a ``Partition`` (``autoopt.passes.partition``) into one ``GraphModule``
per stage: stage 0 takes the graph's flat inputs, each later stage the values crossing the cut
before it (skip connections passed on by the stages between), the last stage the graph's flat
outputs. Parameters keep their names in the original model (``layer1.0.conv1.weight``).

``Pipeline`` runs the stages across devices, each call split into microbatches: GPipe order for
inference and ``forward`` + ``backward``, GPipe or 1F1B for ``train_step``. On CUDA each stage
has a compute stream and a copy stream, so the copy of microbatch m+1's input overlaps stage
compute of microbatch m. ``torch.distributed.pipelining`` runs the same stages across
processes (``autoopt.distributed``).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging
import statistics
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.fx import Graph, GraphModule, Node
from torch.fx._pytree import tree_flatten_spec
from torch.utils import _pytree as pytree

from ..cost_model import CostModel, GraphCost, NodeCost
from ..driver import portable
from ..errors import ConfigError, InputError, ModelError
from ..planning.partition import DeviceSpec, Partition, PartitionError, partition
from ..state import preserved
from ..verify import compare

if TYPE_CHECKING:
    from ..module import OptimizedModule

log = logging.getLogger(__name__)

Action = tuple[str, int, int]  # ("F" or "B", stage, microbatch)


def emit_stages(gm: GraphModule, plan: Partition) -> list[GraphModule]:
    """One ``GraphModule`` per stage of ``plan``; calling them in turn, each on the previous
    one's outputs, computes ``gm``'s flat outputs from its flat inputs."""
    nodes = {n.name: n for n in gm.graph.nodes}
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    output = next(n for n in gm.graph.nodes if n.op == "output")
    stages = []
    for s, stage in enumerate(plan.stages):
        graph = Graph()
        env: dict[Node, Node] = {}
        for node in placeholders if s == 0 else [nodes[name] for name in stage.inputs]:
            env[node] = graph.placeholder(node.name)
            env[node].meta = dict(node.meta)

        def load(node: Node, graph: Graph = graph, env: dict[Node, Node] = env) -> Node:
            if node not in env:
                if node.op != "get_attr":
                    raise AssertionError(f"{node.name} is neither computed in nor sent to this "
                                         f"stage")  # the partition's crossing sets say so
                env[node] = graph.get_attr(str(node.target))
                env[node].meta = dict(node.meta)
            return env[node]

        for name in stage.nodes:
            env[nodes[name]] = graph.node_copy(nodes[name], load)
        if s == len(plan.stages) - 1:
            flat = pytree.tree_leaves(output.args[0], is_leaf=lambda x: x is None)
            graph.output(tuple(load(x) if isinstance(x, Node) else x for x in flat))
        else:
            graph.output(tuple(env[nodes[name]] for name in plan.stages[s + 1].inputs))
        graph.lint()
        stages.append(GraphModule(gm, graph, class_name=f"Stage{s}"))
    return stages


def split_microbatches(flat: Sequence[Any], microbatches: int) -> list[list[Any]]:
    """Split every tensor whose first dimension is the batch into ``microbatches`` equal
    chunks; other values go to every microbatch as they are."""
    if microbatches == 1:
        return [list(flat)]
    tensors = [x for x in flat if isinstance(x, torch.Tensor) and x.dim() > 0]
    if not tensors:
        raise InputError(f"no input tensor has a batch dimension to split into {microbatches} "
                         f"microbatches; use microbatches=1.")
    batch = tensors[0].shape[0]
    if batch % microbatches:
        raise InputError(f"the batch ({batch}) does not split into {microbatches} equal "
                         f"microbatches; use a batch that is a multiple of {microbatches}.")
    out: list[list[Any]] = [[] for _ in range(microbatches)]
    for x in flat:
        parts = (x.chunk(microbatches) if isinstance(x, torch.Tensor) and x.dim() > 0
                 and x.shape[0] == batch else [x] * microbatches)
        for m in range(microbatches):
            out[m].append(parts[m])
    return out


def check_mergeable_outputs(inputs: Sequence[Any], outputs: Sequence[Any], microbatches: int,
                            out_spec: pytree.TreeSpec | None = None) -> None:
    """Refuse outputs that concatenating microbatches along dim 0 would get wrong.

    ``inputs`` and ``outputs`` are one microbatch's flat values (or their ``meta["val"]``). A
    tensor output whose first dimension is not the microbatch's batch (``h.mean(0)``, a
    0-dim loss) was reduced over the batch: each microbatch computed it over its own part,
    and neither concatenating nor taking one of them gives the whole batch's value.

    Raises:
        ConfigError: naming the output, its shape and what to do.
    """
    if microbatches == 1:
        return
    batch = next((x.shape[0] for x in inputs if isinstance(x, torch.Tensor) and x.dim() > 0),
                 None)
    if batch is None:  # inputs without traced values: nothing to tell the batch by
        return
    for i, value in enumerate(outputs):
        if not isinstance(value, torch.Tensor) or (value.dim() > 0 and value.shape[0] == batch):
            continue
        shape = tuple(value.shape)
        got = ("the first microbatch's value instead of the whole batch's" if value.dim() == 0
               else f"shape {(shape[0] * microbatches, *shape[1:])} instead of {shape}")
        raise ConfigError(
            f"{_output_name(i, len(outputs), out_spec)} has shape {shape}, which does not start "
            f"with the microbatch's batch size ({batch}): it is reduced over the batch, so "
            f"each of the {microbatches} microbatches computes it over its own part, and "
            f"merging them would give {got}. Return per-example values and reduce after the "
            f"pipeline, or use microbatches=1.")


def _output_name(i: int, count: int, out_spec: pytree.TreeSpec | None) -> str:
    """``Output ['pooled']`` from the output's structure where it has keys, else ``output i``."""
    if out_spec is not None:
        try:
            paths, _ = pytree.tree_flatten_with_path(pytree.tree_unflatten(range(count),
                                                                           out_spec))
            key = pytree.keystr(paths[i][0])
            return f"Output {key}" if key else "The output"
        except Exception:  # noqa: BLE001 - a structure without key paths: use the index
            pass
    return f"Output {i}"


def shared_parameters(stages: Sequence[GraphModule]) -> list[tuple[str, tuple[int, ...]]]:
    """Parameters that more than one stage reads (tied weights such as an embedding and the LM
    head), each as (its name in the first stage holding it, the indices of those stages), in
    a deterministic order: every rank derives the same list from the same plan."""
    holders: dict[int, tuple[str, list[int]]] = {}
    for s, stage in enumerate(stages):
        for name, param in stage.named_parameters(remove_duplicate=False):
            entry = holders.setdefault(id(param), (name, []))
            if s not in entry[1]:
                entry[1].append(s)
    return sorted((name, tuple(where)) for name, where in holders.values() if len(where) > 1)


def merge_microbatches(outputs: Sequence[Sequence[Any]]) -> list[Any]:
    """Concatenate each output tensor's microbatches along the batch dimension."""
    merged = []
    for parts in zip(*outputs, strict=True):
        first = parts[0]
        if isinstance(first, torch.Tensor) and first.dim() > 0:
            merged.append(torch.cat(parts) if len(parts) > 1 else first)
        else:
            merged.append(first)
    return merged


class Pipeline(nn.Module):
    """Stages on their devices, run as a pipeline over microbatches.

    ``forward`` runs every microbatch through the stages in GPipe order and returns the
    merged output (differentiable end to end: ``loss.backward()`` then gives the unsplit
    model's gradients, up to the floating-point order of summation). ``train_step`` runs
    forward and backward per stage in GPipe or 1F1B order with a per-microbatch loss.

    Args:
        stages: from ``emit_stages``; moved to their devices (copied first where a parameter
            lives elsewhere, so the caller's graph keeps its own).
        devices: one per stage.
        microbatches: microbatches per call.
        plan: the partition the stages come from (shown by ``table``).
        in_spec, out_spec: the pytree structure of the original call and result (from the
            exported graph); None: positional tensors in, a flat tuple out.
    """

    def __init__(self, stages: Sequence[GraphModule], devices: Sequence[str | torch.device],
                 microbatches: int = 1, plan: Partition | None = None,
                 in_spec: pytree.TreeSpec | None = None,
                 out_spec: pytree.TreeSpec | None = None) -> None:
        super().__init__()
        self.devices = [torch.device(d) for d in devices]
        self.stages = nn.ModuleList(_share_tied_weights(
            stages, [place_stage(stage, device)
                     for stage, device in zip(stages, self.devices, strict=True)], self.devices))
        self.microbatches = microbatches
        self.plan = plan
        check_mergeable_outputs(traced_values(stages[0], "placeholder"),
                                traced_values(stages[-1], "output"), microbatches, out_spec)
        self._in_spec = in_spec
        self._out_spec = out_spec
        self._streams = _Streams(self.devices)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        micro = split_microbatches(self._flatten(args, kwargs), self.microbatches)
        self._check_shapes(micro[0])
        for _, s, m in gpipe_order(len(self.stages), self.microbatches, backward=False):
            moved = self._streams.move(s, m, micro[m])
            with self._streams.compute(s):
                micro[m] = list(self.stages[s](*moved))
                self._streams.done(s, m)
        self._streams.synchronize()
        merged = merge_microbatches(micro)
        for x in merged:  # made on a stage's stream, used on the caller's from here on
            if isinstance(x, torch.Tensor) and x.is_cuda:
                x.record_stream(torch.cuda.current_stream(x.device))
        return self._unflatten(merged)

    def train_step(self, args: tuple[Any, ...], target: torch.Tensor,
                   loss_fn: Callable[[Any, torch.Tensor], torch.Tensor], *,
                   kwargs: dict[str, Any] | None = None, schedule: str = "1f1b",
                   scale_grads: bool = True) -> torch.Tensor:
        """Forward and backward over microbatches in ``schedule`` order (``gpipe``, ``1f1b``);
        gradients accumulate in the stages' parameters. Returns the summed loss (divided by
        the microbatch count when ``scale_grads``, as for a mean-reduced loss)."""
        if schedule not in ("gpipe", "1f1b"):
            raise ConfigError(f"schedule must be 'gpipe' or '1f1b'; got {schedule!r}")
        k, n = len(self.stages), self.microbatches
        micro_in = split_microbatches(self._flatten(args, kwargs or {}), n)
        self._check_shapes(micro_in[0])
        targets = split_microbatches([target], n)
        scale = 1.0 / n if scale_grads else 1.0
        saved: dict[tuple[int, int], tuple[list[Any], list[Any]]] = {}
        carry: dict[tuple[int, int], list[Any]] = {(0, m): micro_in[m] for m in range(n)}
        grads: dict[tuple[int, int], list[Any]] = {}
        total = torch.zeros(())
        order = gpipe_order(k, n) if schedule == "gpipe" else one_f_one_b_order(k, n)
        for kind, s, m in order:
            if kind == "F":
                inputs = self._to_stage(s, carry.pop((s, m)), detach=s > 0)
                outputs = list(self.stages[s](*inputs))
                saved[(s, m)] = (inputs, outputs)
                if s < k - 1:
                    carry[(s + 1, m)] = outputs
                continue
            inputs, outputs = saved.pop((s, m))
            if s == k - 1:
                loss = loss_fn(self._unflatten(outputs), targets[m][0].to(self.devices[s]))
                total = total + loss.detach().cpu()
                (loss * scale).backward()
            else:
                pairs = [(o, g) for o, g in zip(outputs, grads.pop((s, m)), strict=True)
                         if isinstance(o, torch.Tensor) and o.requires_grad and g is not None]
                if pairs:
                    torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
            if s > 0:
                grads[(s - 1, m)] = [x.grad.to(self.devices[s - 1])
                                     if isinstance(x, torch.Tensor) and x.grad is not None
                                     else None for x in inputs]
        self._streams.synchronize()
        return total * scale

    def table(self) -> str:
        return self.plan.table() if self.plan is not None else f"{len(self.stages)} stages"

    def named_stage_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """Every stage's parameters under their names in the original model."""
        for stage in self.stages:
            yield from stage.named_parameters()

    # --- running one stage -----------------------------------------------------------------

    def _to_stage(self, s: int, values: list[Any], detach: bool) -> list[Any]:
        """``values`` on stage ``s``'s device (plain copies on the current streams); with
        ``detach`` as new leaves that collect their gradient (where a per-stage backward
        stops)."""
        device = self.devices[s]
        moved = [x.to(device) if isinstance(x, torch.Tensor) else x for x in values]
        if not detach:
            return moved
        return [x.detach().requires_grad_(x.requires_grad) if isinstance(x, torch.Tensor)
                else x for x in moved]

    def _check_shapes(self, flat: list[Any]) -> None:
        """The stages were captured for one microbatch's shapes; others would fail inside."""
        expected = [n.meta.get("val") for n in self.stages[0].graph.nodes
                    if n.op == "placeholder"]
        for i, (value, meta) in enumerate(zip(flat, expected, strict=False)):
            if isinstance(value, torch.Tensor) and isinstance(meta, torch.Tensor) and \
                    tuple(value.shape) != tuple(meta.shape):
                raise InputError(f"input {i} splits into microbatches of shape "
                                 f"{tuple(value.shape)}, but the pipeline was built for "
                                 f"{tuple(meta.shape)} ({self.microbatches} microbatches); "
                                 f"call it with the example's batch size or build another.")

    def _flatten(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
        if self._in_spec is None:
            return list(args)
        try:
            return list(tree_flatten_spec((tuple(args), dict(kwargs)), self._in_spec))
        except Exception as exc:
            raise InputError(f"the pipeline was built for calls shaped like {self._in_spec}; "
                             f"this call does not match ({exc}).") from exc

    def _unflatten(self, flat: Sequence[Any]) -> Any:
        if self._out_spec is None:
            return tuple(flat)
        return pytree.tree_unflatten(list(flat), self._out_spec)


def _share_tied_weights(stages: Sequence[GraphModule], placed: list[GraphModule],
                        devices: Sequence[torch.device]) -> list[GraphModule]:
    """``placed`` with every weight that several stages read held once again.

    Placing a stage on another device copies its weights, so a weight two stages share (an
    embedding tied to the LM head) became two that train apart. The first stage reading it
    keeps it; each later one reads it through a ``.to(device)`` in its graph, so autograd
    sums both stages' gradients into the one parameter.
    """
    for name, holders in shared_parameters(stages):
        original = stages[holders[0]].get_parameter(name)
        owner = placed[holders[0]].get_parameter(name)
        for s in holders[1:]:
            names = [n for n, p in stages[s].named_parameters(remove_duplicate=False)
                     if p is original]
            if all(placed[s].get_parameter(n) is owner for n in names):
                continue
            if placed[s] is stages[s]:  # the caller's stage keeps its own graph
                placed[s] = copy.deepcopy(stages[s])
            stage = placed[s]
            for n in names:
                prefix, _, leaf = n.rpartition(".")
                stage.get_submodule(prefix).register_parameter(leaf, owner)
            for node in list(stage.graph.nodes):
                if node.op == "get_attr" and str(node.target) in names:
                    with stage.graph.inserting_after(node):
                        moved = stage.graph.call_method("to", (node, devices[s]))
                    node.replace_all_uses_with(moved, delete_user_cb=lambda u, m=moved: u is not m)
                    moved.meta = dict(node.meta)
            stage.recompile()
    return placed


def traced_values(gm: GraphModule, op: str) -> list[Any]:
    """The traced values (``meta["val"]``) of ``gm``'s inputs (``placeholder``) or flat outputs
    (``output``); None where a node has none."""
    if op == "placeholder":
        nodes = [n for n in gm.graph.nodes if n.op == "placeholder"]
    else:
        output = next(n for n in gm.graph.nodes if n.op == "output")
        nodes = pytree.tree_leaves(output.args[0], is_leaf=lambda x: x is None)
    return [n.meta.get("val") if isinstance(n, Node) else n for n in nodes]


def place_stage(stage: GraphModule, device: torch.device) -> GraphModule:
    """The stage with its weights and the tensors it creates on ``device``."""
    tensors = list(stage.parameters()) + list(stage.buffers())
    named = [d for n in stage.graph.nodes for d in pytree.tree_leaves((n.args, n.kwargs))
             if isinstance(d, torch.device)]
    if all(t.device == device for t in tensors) and all(d == device for d in named):
        return stage
    placed = copy.deepcopy(stage).to(device)
    # Ops that create tensors (arange, full, _to_copy) name the capture's device in the graph.
    for node in placed.graph.nodes:
        node.args, node.kwargs = pytree.tree_map_only(torch.device, lambda _: device,
                                                      (node.args, node.kwargs))
    placed.recompile()
    return placed


class _Streams:
    """Per-stage CUDA compute and copy streams; plain synchronous copies elsewhere."""

    def __init__(self, devices: Sequence[torch.device]) -> None:
        self.devices = list(devices)
        cuda = [d.type == "cuda" for d in devices]
        self.compute_streams = [torch.cuda.Stream(d) if c else None
                                for d, c in zip(devices, cuda, strict=True)]
        self.copy_streams = [torch.cuda.Stream(d) if c else None
                             for d, c in zip(devices, cuda, strict=True)]
        self.events: dict[tuple[int, int], Any] = {}  # (stage, microbatch) -> its outputs'

    def move(self, s: int, m: int, values: list[Any]) -> list[Any]:
        """Microbatch ``m``'s inputs on stage ``s``'s device."""
        device, stream = self.devices[s], self.copy_streams[s]
        previous = self.events.pop((s - 1, m), None)
        if stream is None:
            if previous is not None:  # a GPU stage's outputs: wait until they are written
                previous.synchronize()
            return [x.to(device) if isinstance(x, torch.Tensor) else x for x in values]
        # The copy waits for the producing stage's compute of this microbatch (or, for the
        # caller's inputs, the streams that made them), then runs beside this stage's compute
        # of the microbatch before; the compute stream waits for the copy.
        callers = {x.device: torch.cuda.current_stream(x.device) for x in values
                   if isinstance(x, torch.Tensor) and x.is_cuda}
        with torch.cuda.stream(stream):
            if previous is not None:
                stream.wait_event(previous)
            else:
                for caller in callers.values():
                    stream.wait_stream(caller)
            moved = []
            for x in values:
                if isinstance(x, torch.Tensor):
                    y = x.to(device, non_blocking=True)
                    if x.is_cuda:
                        x.record_stream(stream)
                    y.record_stream(self.compute_streams[s])
                    moved.append(y)
                else:
                    moved.append(x)
        self.compute_streams[s].wait_stream(stream)
        return moved

    def compute(self, s: int) -> Any:
        stream = self.compute_streams[s]
        return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()

    def done(self, s: int, m: int) -> None:
        if self.compute_streams[s] is not None:
            self.events[(s, m)] = self.compute_streams[s].record_event()

    def synchronize(self) -> None:
        self.events.clear()
        for stream in self.compute_streams:
            if stream is not None:
                stream.synchronize()


def gpipe_order(stages: int, microbatches: int, backward: bool = True) -> list[Action]:
    """All forwards by clock tick (stage s runs microbatch t - s at tick t), then all
    backwards in the mirror order."""
    forward = [("F", s, t - s) for t in range(microbatches + stages - 1)
               for s in range(stages) if 0 <= t - s < microbatches]
    if not backward:
        return forward
    back = [("B", s, t - (stages - 1 - s)) for t in range(microbatches + stages - 1)
            for s in reversed(range(stages)) if 0 <= t - (stages - 1 - s) < microbatches]
    return forward + back


def one_f_one_b_order(stages: int, microbatches: int) -> list[Action]:
    """1F1B: stage s runs ``stages - s - 1`` warm-up forwards, then alternates one forward and
    one backward, then drains its backwards; at most ``stages - s`` microbatches' activations
    are alive on it at once. Returned as one sequence that respects every dependency."""
    per_stage: list[list[Action]] = []
    for s in range(stages):
        warm = min(stages - s - 1, microbatches)
        actions: list[Action] = [("F", s, m) for m in range(warm)]
        f, b = warm, 0
        while f < microbatches:
            actions += [("F", s, f), ("B", s, b)]
            f, b = f + 1, b + 1
        actions += [("B", s, m) for m in range(b, microbatches)]
        per_stage.append(actions)
    done: set[Action] = set()
    order: list[Action] = []
    cursor = [0] * stages
    while len(order) < stages * microbatches * 2:
        progressed = False
        for s in range(stages):
            if cursor[s] == len(per_stage[s]):
                continue
            kind, _, m = action = per_stage[s][cursor[s]]
            ready = (("F", s - 1, m) in done or s == 0) if kind == "F" else \
                (("B", s + 1, m) in done or s == stages - 1) and ("F", s, m) in done
            if ready:
                order.append(action)
                done.add(action)
                cursor[s] += 1
                progressed = True
        if not progressed:  # every stage's next step waits on another: a bug in the lists
            raise AssertionError(f"1F1B order deadlocked after {order}")
    return order


# --- building a pipeline from a model --------------------------------------------------------


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


def pipeline_from_graph(gm: GraphModule, plan: Partition, microbatches: int = 1) -> Pipeline:
    """The local pipeline of ``gm`` cut as ``plan`` says, on the plan's devices."""
    info = getattr(gm.graph._codegen, "pytree_info", None)
    return Pipeline(emit_stages(gm, plan), [s.device for s in plan.stages], microbatches, plan,
                    info.in_spec if info else None, info.out_spec if info else None)


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
    if any(torch.device(d).type != optimized.cost_model.device.type for d in devices):
        # Lowered kernels (oneDNN's packed convolutions) run only on the capture's device
        # type; stages elsewhere get the graph from before lowering.
        gm = portable(gm)
    flat = pytree.tree_leaves((micro_args, micro_kwargs))
    specs = measured_device_specs(devices, optimized.cost_model)
    plan = plan_stages(gm, flat, specs, cost_model=optimized.cost_model,
                       microbatches=config.microbatches, training=training)
    pipe = pipeline_from_graph(gm, plan, config.microbatches)
    pipe.report = optimized.report
    if config.verify:
        # Both runs start from the caller's inputs as given (a forward may write them in
        # place), and neither leaves a trace on them, the model or the stages.
        with torch.no_grad(), preserved(optimized.module, pipe, args, kwargs):
            torch.manual_seed(0)
            with preserved(args, kwargs):
                expected = optimized.module(*args, **kwargs)
            torch.manual_seed(0)
            result = compare(expected, pipe(*args, **kwargs), config.verification_tolerances)
        if not result.ok:
            raise ModelError(f"the pipeline over {config.microbatches} microbatches differs "
                             f"from eager ({result.detail}): the model's function depends on "
                             f"how the batch is split (BatchNorm batch statistics or dropout "
                             f"masks in training). Use microbatches=1, or verify=False to "
                             f"accept it.")
    log.info("pipeline over %s:\n%s", devices, plan.table())
    return pipe


# --- the ``autoopt partition`` command ---------------------------------------------------------

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "kib": 2**10,
          "mib": 2**20, "gib": 2**30, "tib": 2**40}


def _require_matplotlib() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError as exc:
        raise ConfigError("--plot needs matplotlib, which is not installed: "
                          "pip install matplotlib (or leave out --plot)") from exc


def plot_stages(plan: Partition, path: str) -> None:
    """A bar chart per stage: predicted time (compute and transfer) and memory."""
    _require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")  # files only; no display needed
    import matplotlib.pyplot as plt

    index = [s.index for s in plan.stages]
    fig, (times, memory) = plt.subplots(1, 2, figsize=(10, 4))
    compute = [s.compute_s * 1e3 for s in plan.stages]
    times.bar(index, compute, label="compute")
    times.bar(index, [s.transfer_s * 1e3 for s in plan.stages], bottom=compute,
              label="input transfer")
    times.axhline(plan.ideal_s * 1e3, color="gray", linestyle="--", label="ideal")
    times.set(xlabel="stage", ylabel="ms per microbatch",
              title=f"time (balance {plan.balance:.2f})")
    times.legend()
    params = [s.parameter_bytes / 2**20 for s in plan.stages]
    memory.bar(index, params, label="parameters")
    memory.bar(index, [s.activation_bytes / 2**20 for s in plan.stages], bottom=params,
               label="activations")
    memory.set(xlabel="stage", ylabel="MiB", title="memory")
    for axes in (times, memory):
        axes.set_xticks(index)
    memory.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
