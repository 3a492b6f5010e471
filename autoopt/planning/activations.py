"""What a training graph saves for backward: one run of the graph with saved-tensor hooks lists,
per node, the storages its ops save, and cuts the nodes into segments for the memory plan."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.fx import GraphModule, Interpreter, Node
from torch.utils import _pytree as pytree

from autoopt.cost_model.isolation import preserved, unwritten_inputs
from autoopt.passes import ops
from autoopt.planning.segments import SavedActivation, Segment

# Ops whose results a selective recompute keeps (costly to run again, per byte they make): the
# graph-level spellings, for planning, and the kernels a decomposed graph calls. Each runs as one
# of ``ops.COSTLY_KERNELS``, which ``autoopt.runtime.recompute`` keeps.
_HEAVY_OPS = ops.COSTLY | ops.ATTENTION_KERNELS
_COMPUTE_OPS = ("call_function", "call_method", "call_module")


@dataclass
class ActivationProfile:
    """What one run of the graph with gradients saved for backward, per node, and each node's
    predicted forward time; cut it into segments with ``segments(count)``.

    Args:
        order: the compute nodes in execution order.
        saved_by_node: per node, the storages (pointer -> bytes) its op saved.
        producer: per storage pointer, the node that produced it.
        storage_of: per node, its result's storage (pointer, bytes), parameters excluded.
        times: per node, predicted forward seconds.
        heavy_nodes: the matmul, convolution and attention nodes (kept by selective
            recompute).
    """

    order: list[Node]
    saved_by_node: dict[str, dict[int, int]]
    producer: dict[int, str]
    storage_of: dict[str, tuple[int, int]]
    times: dict[str, float]
    heavy_nodes: frozenset[str] = frozenset()

    @property
    def saved_bytes(self) -> int:
        """Bytes of distinct storages saved over the whole graph."""
        return sum({p: b for per in self.saved_by_node.values() for p, b in per.items()}.values())

    def segments(self, count: int) -> tuple[list[Segment], list[SavedActivation]]:
        """Cut into up to ``count`` contiguous segments of near-equal saved bytes."""
        segments, activations = [], []
        groups = _cut(self.order, self.saved_by_node, self.storage_of, count)
        for index, group in enumerate(groups):
            names = {n.name for n in group}
            saved: dict[int, int] = {}
            inputs: dict[int, int] = {}
            for node in group:
                for ptr, nbytes in self.saved_by_node.get(node.name, {}).items():
                    saved[ptr] = nbytes
                    activations.append(SavedActivation(node.name, self.producer.get(ptr, "?"),
                                                       nbytes, index))
                for arg in _node_args(node):
                    if arg.name not in names and arg.name in self.storage_of:
                        ptr, nbytes = self.storage_of[arg.name]
                        inputs[ptr] = nbytes
            heavy: dict[int, int] = {}
            for node in group:
                if node.name in self.heavy_nodes:
                    heavy.update(self._results(node.name))
            # Checkpoint's rerun stops after the last op that saves a tensor.
            saving = [i for i, n in enumerate(group) if self.saved_by_node.get(n.name)]
            rerun = group[:saving[-1] + 1] if saving else []
            segments.append(Segment(
                index, tuple(n.name for n in group), tuple(saved.items()),
                tuple(inputs.items()), sum(self.times.get(n, 0.0) for n in names),
                tuple(heavy.items()), sum(self.times.get(n.name, 0.0) for n in rerun),
                sum(self.times.get(n.name, 0.0) for n in rerun
                    if n.name not in self.heavy_nodes),
                any(_writes_state(n) for n in group)))
        return segments, activations

    def _results(self, name: str) -> dict[int, int]:
        """The storages a node makes: its result, and what it saves that no node returned
        (an attention kernel's log-sum-exp)."""
        made = dict([self.storage_of[name]]) if name in self.storage_of else {}
        for ptr, nbytes in self.saved_by_node.get(name, {}).items():
            if self.producer.get(ptr, name) == name:
                made[ptr] = nbytes
        return made


def profile_activations(gm: GraphModule, example_inputs: Sequence[Any],
                        cost: Any = None) -> ActivationProfile:
    """Run ``gm`` once with gradients and saved-tensor hooks to list what each node saves;
    price each node's forward with ``cost`` (a ``CostModel``; None: every node 0 s).

    The runs leave no trace: buffers (BatchNorm statistics, counters), Python attributes, the
    inputs and the RNG are as they were (``preserved``).
    """
    recorder = _SavedRecorder(gm)
    times: dict[str, float] = {}
    with preserved(gm, example_inputs):
        recorder.record(unwritten_inputs(gm, example_inputs))
    if cost is not None:
        graph_cost = cost.profile(gm, list(example_inputs))  # which puts back what it changes
        times = {name: c.latency_s for name, c in graph_cost.by_node.items()}
    order = [n for n in gm.graph.nodes if n.op in _COMPUTE_OPS and str(n.target) != "_guards_fn"]
    heavy = frozenset(n.name for n in order if _is_heavy(n, gm))
    return ActivationProfile(order, recorder.saved_by_node, recorder.producer,
                             recorder.storage_of, times, heavy)


def _writes_state(node: Node) -> bool:
    """Whether the op writes in place (per its schema) or updates running statistics."""
    if node.op == "call_module":
        return True  # a module may hold state (symbolic_trace graphs): assume it does
    schema = getattr(node.target, "_schema", None)
    if schema is not None and schema.is_mutable:
        return True
    return "batch_norm" in str(node.target) or "instance_norm" in str(node.target)


def _is_heavy(node: Node, gm: GraphModule) -> bool:
    if node.op == "call_module":
        module = gm.get_submodule(str(node.target))
        # Subclasses too (LazyLinear, a user's Conv2d subclass): they still run a GEMM.
        return isinstance(module, _HEAVY_OPS.modules)
    return node.op == "call_function" and node.target in _HEAVY_OPS.functions


def _cut(order: Sequence[Node], saved: dict[str, dict[int, int]],
         storage_of: dict[str, tuple[int, int]], count: int) -> list[list[Node]]:
    """``count`` contiguous groups of near-equal saved bytes, each cut moved to the point
    nearby where the fewest activation bytes cross it (a recomputed segment keeps what
    crosses its start, so narrow cuts make recompute pay)."""
    weights = [sum(saved.get(n.name, {}).values()) for n in order]
    total = sum(weights) or 1
    running, cuts = 0, []
    for i, w in enumerate(weights):
        group = min(count - 1, int((running + w / 2) / total * count))
        if i and group > len(cuts):
            cuts.append(i)
        running += w
    crossing = _crossing_bytes(order, storage_of)
    reach = max(1, len(order) // (4 * max(count, 1)))
    snapped = []
    for cut in cuts:
        window = range(max(1, cut - reach), min(len(order) - 1, cut + reach) + 1)
        snapped.append(min(window, key=lambda p: (crossing[p], abs(p - cut)), default=cut))
    bounds = [0, *sorted(set(snapped)), len(order)]
    return [list(order[a:b]) for a, b in zip(bounds, bounds[1:], strict=False) if b > a]


def _crossing_bytes(order: Sequence[Node], storage_of: dict[str, tuple[int, int]]) -> list[int]:
    """Per position p, the bytes of activations made before ``order[p]`` and used from it on."""
    position = {n: i for i, n in enumerate(order)}
    last_use = {}
    for i, node in enumerate(order):
        for arg in _node_args(node):
            last_use[arg] = i
    for node in order:  # results the graph returns live to the end
        if any(u.op == "output" for u in node.users):
            last_use[node] = len(order)
    crossing = [0] * (len(order) + 1)
    for node, last in last_use.items():
        if node.name not in storage_of:
            continue
        first = position.get(node, -1) + 1  # graph inputs cross every cut up to their last use
        for p in range(first, last + 1 if last < len(order) else len(order) + 1):
            crossing[p] += storage_of[node.name][1]
    return crossing


def _node_args(node: Node) -> list[Node]:
    return [a for a in pytree.tree_leaves((node.args, node.kwargs)) if isinstance(a, Node)]


class _SavedRecorder(Interpreter):
    """Runs the graph once with gradients; records, per node, the storages its ops save for
    backward (module state excluded), and which node produced each storage."""

    def __init__(self, gm: GraphModule) -> None:
        super().__init__(gm)
        # Module state (parameters, buffers, folded constants) is held anyway: not activations.
        self._parameters = {t.untyped_storage().data_ptr()
                            for t in (*gm.parameters(), *gm.buffers())}
        self._current = ""
        self._alive: list[Any] = []
        self.saved_by_node: dict[str, dict[int, int]] = {}
        self.producer: dict[int, str] = {}
        self.storage_of: dict[str, tuple[int, int]] = {}

    def record(self, inputs: Sequence[Any]) -> None:
        """Run once (the caller puts back what the run changes)."""
        try:
            with torch.enable_grad(), \
                    torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t):
                self.run(*inputs)
        finally:
            self._alive.clear()

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in self._parameters and storage.nbytes():
            self.saved_by_node.setdefault(self._current, {})[ptr] = storage.nbytes()
        return t

    def run_node(self, n: Node) -> Any:
        self._current = n.name
        result = super().run_node(n)
        # Held to the end of the run, so no two storages share a pointer (their id here).
        self._alive.append(result)
        if isinstance(result, torch.Tensor) and n.op != "get_attr":
            storage = result.untyped_storage()
            ptr = storage.data_ptr()
            self.producer.setdefault(ptr, n.name)
            if ptr not in self._parameters:
                self.storage_of[n.name] = (ptr, storage.nbytes())
        return result
