"""Cut a graph into pipeline stages of balanced measured time, under each device's memory.

    compute nodes in topological order:  n0 n1 n2 | n3 n4 n5 n6 | n7 n8
                                          stage 0 ^  stage 1    ^ stage 2
                                          cut 3: the values made before n3 and used
                                          from n3 on cross to stage 1 (skip connections
                                          included: a stage passes them on)

Stages are contiguous runs of the graph's compute nodes in its (topological) order, so a stage
never needs a later stage's output, for branching graphs too. A stage's time is its nodes'
cost-model time divided by its device's speed, plus the time to receive what crosses the cut
before it over the device's link. ``partition`` finds the cut that minimises the largest stage
time (the pipeline's bottleneck) exactly, by dynamic programming over cut positions, subject to
each device's memory: parameters plus activations for the microbatches in flight.

This module only reads costs (a ``GraphCost`` from ``autoopt.cost_model``); it times nothing.

Example:
    >>> cost = CostModel("cpu").profile(gm, inputs)
    >>> plan = partition(gm, cost, [DeviceSpec("cpu")] * 4)
    >>> print(plan.table())
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise

import networkx as nx
import numpy as np
import torch
from torch.fx import GraphModule, Node

from autoopt.cost_model.estimate import is_view, tensor_bytes
from autoopt.cost_model.model import GraphCost
from autoopt.passes.graph import attr

log = logging.getLogger(__name__)

COMPUTE_OPS = ("call_function", "call_method", "call_module")


class PartitionError(ValueError):
    """No partition into the requested stages exists; the message says why and what to do."""


@dataclass(frozen=True)
class DeviceSpec:
    """One pipeline stage's device, as the partitioner sees it.

    Args:
        name: the torch device (``cpu``, ``cuda:1``).
        speed: throughput relative to the device the costs were measured on (2.0: twice as
            fast); a stage's compute time is its measured time divided by this.
        memory_bytes: what the stage may hold (parameters plus activations); None: no cap.
        link_bytes_per_s: bandwidth of the link the stage receives its inputs over.
    """

    name: str = "cpu"
    speed: float = 1.0
    memory_bytes: int | None = None
    link_bytes_per_s: float = 10e9


@dataclass(frozen=True)
class StagePlan:
    """One stage of a partition, with its predicted cost.

    Args:
        index: position in the pipeline.
        device: the device it runs on.
        nodes: names of its compute nodes, in execution order.
        compute_s: predicted compute time on its device (per microbatch).
        transfer_s: predicted time to receive its inputs from the stage before.
        parameter_bytes: parameters and buffers its nodes read (each stage that reads a tied
            weight holds it, so it counts in each).
        activation_bytes: activation memory it needs for the microbatches in flight.
        inputs: the values it receives (graph inputs for stage 0), as node names.
        input_bytes: their size.
    """

    index: int
    device: str
    nodes: tuple[str, ...]
    compute_s: float
    transfer_s: float
    parameter_bytes: int
    activation_bytes: int
    inputs: tuple[str, ...]
    input_bytes: int

    @property
    def time_s(self) -> float:
        return self.compute_s + self.transfer_s

    @property
    def memory_bytes(self) -> int:
        return self.parameter_bytes + self.activation_bytes


@dataclass(frozen=True)
class Partition:
    """A cut of a graph into pipeline stages.

    Args:
        stages: the stages, in pipeline order.
        cuts: for each stage after the first, the index (in compute order) of its first node.
        outputs: the values the last stage returns, as node names (the graph's outputs).
        bottleneck_s: the largest stage time: one pipeline step.
        ideal_s: total compute time over total device speed: a perfectly balanced step.
    """

    stages: tuple[StagePlan, ...]
    cuts: tuple[int, ...]
    outputs: tuple[str, ...]
    bottleneck_s: float
    ideal_s: float

    @property
    def balance(self) -> float:
        """bottleneck / ideal: 1.0 is perfect balance."""
        return self.bottleneck_s / self.ideal_s if self.ideal_s > 0 else 1.0

    def table(self) -> str:
        """The stages as a text table."""
        rows = [f"{'stage':>5} {'device':<8} {'nodes':>5} {'compute ms':>10} {'transfer ms':>11}"
                f" {'params MiB':>10} {'activ MiB':>9}  inputs"]
        for s in self.stages:
            shown = ", ".join(s.inputs[:4]) + (f", +{len(s.inputs) - 4}" if len(s.inputs) > 4
                                               else "")
            rows.append(f"{s.index:>5} {s.device:<8} {len(s.nodes):>5} {s.compute_s * 1e3:>10.3f}"
                        f" {s.transfer_s * 1e3:>11.3f} {s.parameter_bytes / 2**20:>10.2f}"
                        f" {s.activation_bytes / 2**20:>9.2f}  {shown}")
        rows.append(f"bottleneck {self.bottleneck_s * 1e3:.3f} ms, ideal "
                    f"{self.ideal_s * 1e3:.3f} ms, balance {self.balance:.3f}")
        return "\n".join(rows)


class NodeProfile:
    """Per-node arrays the partitioner works on, in compute order (N nodes, N+1 cut positions:
    cut c means a stage starts at node c): time, parameter bytes, live activation bytes,
    bytes crossing each cut, and the cuts a non-tensor value would cross (``forbidden``)."""

    def __init__(self, gm: GraphModule, cost: GraphCost, training: bool) -> None:
        self.order = [n for n in gm.graph.nodes if n.op in COMPUTE_OPS]
        n = len(self.order)
        index = {node: i for i, node in enumerate(self.order)}
        self.time = np.array([_latency(cost, node) for node in self.order], dtype=np.float64)
        self.params = np.zeros(n, dtype=np.float64)
        self.saved = np.zeros(n, dtype=np.float64)
        crossing = np.zeros(n + 2, dtype=np.float64)
        live = np.zeros(n + 2, dtype=np.float64)
        unsendable = np.zeros(n + 2, dtype=np.int64)
        self.values: list[tuple[Node, int, int]] = []  # (value, defined at, last used at)
        attributes: dict[int, tuple[int, list[int]]] = {}  # tensor id -> (bytes, user indices)
        for node in gm.graph.nodes:
            if node.op == "get_attr":
                value = attr(gm, node)
                if isinstance(value, torch.Tensor):
                    size = value.numel() * value.element_size()
                    entry = attributes.setdefault(id(value), (size, []))
                    entry[1].extend(index[u] for u in node.users if u in index)
                continue
            if node.op not in COMPUTE_OPS and node.op != "placeholder":
                continue
            defined = index.get(node, -1)  # placeholders exist before the first node
            uses = [n if u.op == "output" else index[u] for u in node.users
                    if u.op == "output" or u in index]
            last = max(uses, default=max(defined, 0))
            val = node.meta.get("val")
            size = tensor_bytes(val)
            self.values.append((node, defined, last))
            crossing[defined + 1] += size
            crossing[last + 1] -= size
            # Only tensors can be sent between stages; a graph input that is a constant is
            # passed along as it is.
            if not isinstance(val, torch.Tensor) and node.op != "placeholder":
                unsendable[defined + 1] += 1
                unsendable[last + 1] -= 1
            if node.op == "placeholder" or not is_view(node.target):
                live[max(defined, 0)] += size
                live[last + 1] -= size
            if defined >= 0:
                saved = cost.by_node[node.name].saved_bytes if node.name in cost.by_node else 0
                self.saved[defined] = saved if (training and saved) else \
                    (0 if is_view(node.target) else size)
        # A parameter is counted at its first user; a later stage that reads it too (a tied
        # weight, a layer applied twice) holds a copy of its own, added by ``shared_bytes``.
        self.shared: list[tuple[int, np.ndarray]] = []
        for size, users in attributes.values():
            if users:
                ordered = np.unique(np.array(users, dtype=np.int64))
                self.params[ordered[0]] += size
                if len(ordered) > 1:
                    self.shared.append((size, ordered))
        self.crossing = np.cumsum(crossing)[: n + 1]
        self.live = np.cumsum(live)[:n]
        self.forbidden = np.cumsum(unsendable)[: n + 1] > 0
        self.forbidden[0] = self.forbidden[n] = False  # the graph's own inputs and outputs
        self.time_prefix = np.concatenate([[0.0], np.cumsum(self.time)])
        self.param_prefix = np.concatenate([[0.0], np.cumsum(self.params)])
        self.saved_prefix = np.concatenate([[0.0], np.cumsum(self.saved)])
        self.outputs = tuple(v.name for v, _, last in self.values if last == n
                             and any(u.op == "output" for u in v.users))

    def shared_bytes(self, i: np.ndarray | int, j: int) -> np.ndarray | float:
        """Bytes of the tensors that stage [i, j) reads but that an earlier stage, holding
        their first user, is counted for (vectorised over ``i``)."""
        starts = np.asarray(i)
        extra = np.zeros(starts.shape)
        for size, users in self.shared:
            following = np.searchsorted(users, starts)  # the first user at or after the start
            next_user = np.where(following < len(users),
                                 users[np.minimum(following, len(users) - 1)], j)
            extra += size * ((users[0] < starts) & (next_user < j))
        return extra if extra.ndim else float(extra)

    def crossing_names(self, cut: int) -> tuple[str, ...]:
        """The values that cross cut ``cut``, in graph order."""
        return tuple(v.name for v, defined, last in self.values if defined < cut <= last)


def _latency(cost: GraphCost, node: Node) -> float:
    found = cost.by_node.get(node.name)
    return found.stage_s if found is not None else 0.0


def _activation(profile: NodeProfile, i: np.ndarray | int, j: int, peak: np.ndarray | float,
                microbatches: int, training: bool) -> np.ndarray | float:
    """Activation bytes of stage [i, j): the peak alive while one microbatch runs, plus, when
    training under GPipe, what every other microbatch in flight keeps for backward."""
    if not training:
        return peak
    return peak + (microbatches - 1) * (profile.saved_prefix[j] - profile.saved_prefix[i])


def partition(gm: GraphModule, cost: GraphCost, devices: Sequence[DeviceSpec], *,
              microbatches: int = 1, training: bool = False) -> Partition:
    """Cut ``gm`` into ``len(devices)`` stages minimising the pipeline's bottleneck.

    Exact over cuts contiguous in the graph's node order (a dynamic program, O(K·N²) with a
    vectorised inner loop): no other such cut has a smaller largest stage time under the same
    costs and memory caps.

    Args:
        gm: the graph (every node with ``meta["val"]``).
        cost: per-node costs of ``gm`` (``CostModel.profile`` or ``predict``).
        devices: one per stage, in pipeline order.
        microbatches: microbatches per step (for the activation memory in flight).
        training: whether the pipeline runs backward too (GPipe keeps every microbatch's
            saved activations until its backward).

    Raises:
        PartitionError: no stages asked for, no compute nodes or fewer than stages, a node bigger
            than every device's memory, or no cut that fits the memory caps.
    """
    k = len(devices)
    if k < 1:
        raise PartitionError("stages must be at least 1; got 0 devices. Pass one device per "
                             "stage, e.g. devices=['cuda:0', 'cuda:1'].")
    if microbatches < 1:
        raise PartitionError(f"microbatches must be at least 1; got {microbatches}")
    profile = NodeProfile(gm, cost, training)
    n = len(profile.order)
    if n == 0:
        raise PartitionError(f"the graph has no compute nodes (its outputs are its inputs or "
                             f"constants), so there is nothing to cut into {k} stages; run the "
                             f"model as it is, without a pipeline.")
    if k > n:
        raise PartitionError(f"cannot cut a graph of {n} compute nodes into {k} stages: every "
                             f"stage needs at least one node. Ask for at most {n} stages.")
    _check_nodes_fit(profile, devices, microbatches, training)
    best = np.full((k + 1, n + 1), np.inf)
    start = np.zeros((k + 1, n + 1), dtype=np.int64)
    best[0, 0] = 0.0
    blocked = np.where(profile.forbidden, np.inf, 0.0)
    for s, device in enumerate(devices):
        cap = np.inf if device.memory_bytes is None else float(device.memory_bytes)
        transfer = profile.crossing / device.link_bytes_per_s if s > 0 else np.zeros(n + 1)
        transfer = transfer + (blocked if s > 0 else 0.0)
        # Stage s ends at j (exclusive); it needs s nodes before it and k-s-1 after.
        for j in range(s + 1, n - (k - s - 1) + 1):
            i = np.arange(s, j)
            before = best[s, s:j]
            if not np.isfinite(before).any():
                continue
            stage = (profile.time_prefix[j] - profile.time_prefix[s:j]) / device.speed
            stage = stage + transfer[s:j]
            if np.isfinite(cap):
                peak = np.maximum.accumulate(profile.live[s:j][::-1])[::-1]
                memory = (profile.param_prefix[j] - profile.param_prefix[s:j]
                          + profile.shared_bytes(i, j)
                          + _activation(profile, i, j, peak, microbatches, training))
                stage = np.where(memory > cap, np.inf, stage)
            step = np.maximum(before, stage)
            pick = int(np.argmin(step))
            best[s + 1, j] = step[pick]
            start[s + 1, j] = s + pick
    if not np.isfinite(best[k, n]):
        raise PartitionError(_infeasible_reason(profile, devices))
    cuts = []
    j = n
    for s in range(k, 1, -1):
        j = int(start[s, j])
        cuts.append(j)
    return evaluate(gm, cost, devices, tuple(reversed(cuts)), microbatches=microbatches,
                    training=training, profile=profile)


def evaluate(gm: GraphModule, cost: GraphCost, devices: Sequence[DeviceSpec],
             cuts: Sequence[int], *, microbatches: int = 1, training: bool = False,
             profile: NodeProfile | None = None) -> Partition:
    """The partition that ``cuts`` make (any cuts, e.g. a baseline's), with its predicted
    stage times, memory and boundary tensors, under the same costs ``partition`` uses."""
    profile = profile or NodeProfile(gm, cost, training)
    n = len(profile.order)
    bounds = [0, *cuts, n]
    if len(bounds) != len(devices) + 1 or any(a >= b for a, b in pairwise(bounds)):
        raise PartitionError(f"cuts {list(cuts)} do not make {len(devices)} non-empty stages "
                             f"of {n} nodes")
    blocked = [c for c in cuts if profile.forbidden[c]]
    if blocked:
        raise PartitionError(f"cannot cut before node {profile.order[blocked[0]].name}: a "
                             f"value that is not a tensor would cross the cut")
    stages = []
    for s, (device, a, b) in enumerate(zip(devices, bounds, bounds[1:], strict=False)):
        peak = float(profile.live[a:b].max())
        inputs = profile.crossing_names(a)
        stages.append(StagePlan(
            index=s, device=device.name, nodes=tuple(x.name for x in profile.order[a:b]),
            compute_s=float(profile.time_prefix[b] - profile.time_prefix[a]) / device.speed,
            transfer_s=float(profile.crossing[a]) / device.link_bytes_per_s if s else 0.0,
            parameter_bytes=int(profile.param_prefix[b] - profile.param_prefix[a]
                                + profile.shared_bytes(a, b)),
            activation_bytes=int(_activation(profile, a, b, peak, microbatches, training)),
            inputs=inputs, input_bytes=int(profile.crossing[a])))
    total_speed = sum(d.speed for d in devices)
    return Partition(tuple(stages), tuple(cuts), profile.outputs,
                     max(s.time_s for s in stages), float(profile.time_prefix[n]) / total_speed)


def allowed_cuts(gm: GraphModule) -> list[int]:
    """Positions (in compute order) a stage may start at: where only tensors cross."""
    profile = NodeProfile(gm, GraphCost((), 0.0, 0, 0, 0.0), training=False)
    return [c for c in range(1, len(profile.order)) if not profile.forbidden[c]]


def _check_nodes_fit(profile: NodeProfile, devices: Sequence[DeviceSpec], microbatches: int,
                     training: bool) -> None:
    caps = [d.memory_bytes for d in devices]
    if any(c is None for c in caps):
        return
    largest = max(c for c in caps if c is not None)
    for i, node in enumerate(profile.order):
        params = profile.params[i] + profile.shared_bytes(i, i + 1)
        need = params + _activation(profile, i, i + 1, profile.live[i], microbatches, training)
        if need > largest:
            raise PartitionError(
                f"node {node.name} ({node.target}) alone needs {need / 2**20:.1f} MiB "
                f"(parameters {params / 2**20:.1f} MiB plus activations), more than "
                f"the largest device memory, {largest / 2**20:.1f} MiB; give the devices more "
                f"memory or use fewer microbatches / a smaller batch.")


def _infeasible_reason(profile: NodeProfile, devices: Sequence[DeviceSpec]) -> str:
    n = len(profile.order)
    allowed = int((~profile.forbidden[1:n]).sum())
    if allowed < len(devices) - 1:
        return (f"the graph can be cut at only {allowed} place(s) (elsewhere a non-tensor value "
                f"crosses the cut), too few for {len(devices)} stages; ask for at most "
                f"{allowed + 1} stages.")
    params = profile.param_prefix[-1] / 2**20
    caps = ", ".join("unlimited" if d.memory_bytes is None else f"{d.memory_bytes / 2**20:.1f}"
                     for d in devices)
    return (f"no cut into {len(devices)} stages fits the devices' memory (MiB: {caps}); the "
            f"model has {params:.1f} MiB of parameters plus activations. Add devices, give them "
            f"more memory, or use fewer microbatches.")


def to_networkx(gm: GraphModule, cost: GraphCost,
                devices: Sequence[DeviceSpec] = (DeviceSpec(),)) -> nx.DiGraph:
    """The graph's compute nodes and inputs as a ``DiGraph`` with the partitioner's weights.

    Node attributes: ``time_s`` (measured or estimated), ``time_on`` (seconds on each device,
    by name), ``parameter_bytes``, ``activation_bytes`` (its result's size), ``index`` (compute
    order; -1 for graph inputs). Edge attributes: ``bytes`` (the producer's result) and
    ``transfer_s`` (seconds over each device's link, by name).
    """
    profile = NodeProfile(gm, cost, training=False)
    graph = nx.DiGraph()
    index = {node: i for i, node in enumerate(profile.order)}
    for node, _, _ in profile.values:
        i = index.get(node, -1)
        time_s = float(profile.time[i]) if i >= 0 else 0.0
        graph.add_node(node.name, index=i, op=str(node.target), time_s=time_s,
                       time_on={d.name: time_s / d.speed for d in devices},
                       parameter_bytes=int(profile.params[i]) if i >= 0 else 0,
                       activation_bytes=tensor_bytes(node.meta.get("val")))
    for node, _, _ in profile.values:
        size = tensor_bytes(node.meta.get("val"))
        for user in node.users:
            if user in index:
                graph.add_edge(node.name, user.name, bytes=size,
                               transfer_s={d.name: size / d.link_bytes_per_s for d in devices})
    return graph


def stage_graph(graph: nx.DiGraph, plan: Partition) -> nx.DiGraph:
    """Stages as nodes, an edge where a value flows from one stage to another (with its
    bytes): acyclic, with every edge pointing forward, for any partition."""
    stage_of = {name: s.index for s in plan.stages for name in s.nodes}
    stages = nx.DiGraph()
    stages.add_nodes_from(range(len(plan.stages)))
    for u, v, data in graph.edges(data=True):
        a, b = stage_of.get(u, 0), stage_of[v]
        if a != b:
            previous = stages.get_edge_data(a, b, {"bytes": 0})["bytes"]
            stages.add_edge(a, b, bytes=previous + data["bytes"])
    return stages
