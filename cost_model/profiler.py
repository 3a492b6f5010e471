"""Running a graph to time its nodes: each alone on its real inputs (``NodeProfiler``), or
each where it stands in whole-graph runs (``InModelTimer``). ``CostModel.profile`` reads both."""

from __future__ import annotations

import logging
import warnings
from typing import Any

import torch
from torch.fx import GraphModule, Interpreter, Node
from torch.utils import _pytree as pytree

from .estimate import op_name
from .isolation import written_arguments
from .timing import median_seconds, timed

log = logging.getLogger(__name__)

# Ops that write to their inputs run on clones, rotated so each repeat starts from fresh data.
_MUTATED_COPIES = 2
# Submodules that are bookkeeping, not work (torch.export's guard function).
SKIPPED_MODULES = ("_guards_fn",)


class InModelTimer(Interpreter):
    """Runs the graph, timing each op node where it stands in the run."""

    def __init__(self, gm: GraphModule, device: torch.device) -> None:
        super().__init__(gm)
        self.device = device
        self.samples: dict[str, list[float]] = {}
        # On CUDA: (node, event after it) of the current run, read once it has finished.
        self._events: list[tuple[str, Any]] = []
        self.totals: list[float] = []  # on CUDA: each run's timeline, first event to last

    def run(self, *args: Any, **kwargs: Any) -> Any:
        if self.device.type != "cuda":
            return super().run(*args, **kwargs)
        first = torch.cuda.Event(enable_timing=True)
        first.record()
        result = super().run(*args, **kwargs)
        torch.cuda.synchronize(self.device)
        previous = first
        for name, end in self._events:
            self.samples.setdefault(name, []).append(previous.elapsed_time(end) / 1e3)
            previous = end
        if self._events:
            self.totals.append(first.elapsed_time(previous) / 1e3)
        self._events.clear()
        return result

    def run_node(self, n: Node) -> Any:
        if n.op not in ("call_function", "call_method", "call_module"):
            return super().run_node(n)
        args, kwargs = self.fetch_args_kwargs_from_env(n)  # outside the timed span
        if self.device.type == "cuda":
            # Events in the stream, no syncs: a node's time is what it adds to the stream's
            # timeline, from the previous node's end to its own (its kernels when the GPU is
            # behind, its launch when the host is), so a launch-bound model is timed as it
            # runs, not stalled by a sync per node.
            result = getattr(self, n.op)(n.target, args, kwargs)
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._events.append((n.name, end))
            return result
        result, seconds = timed(lambda: getattr(self, n.op)(n.target, args, kwargs),
                                self.device)
        self.samples.setdefault(n.name, []).append(seconds)
        return result


class NodeProfiler(Interpreter):
    """Runs the graph once; times each op node alone on its real inputs as it goes, and asks
    ``model`` (the ``CostModel``) for each node's cost from that measurement."""

    def __init__(self, gm: GraphModule, model: Any, training: bool) -> None:
        super().__init__(gm)
        self.model = model
        self.training = training
        self.costs: dict[str, Any] = {}  # NodeCost by node name
        self.new_entries: dict[str, dict[str, Any]] = {}
        # Parameters are held for backward by reference, not as new memory: not counted.
        self._parameter_storages = {t.data_ptr() for t in gm.parameters()} if training else set()

    def run_node(self, n: Node) -> Any:
        result = super().run_node(n)
        if n.op not in ("call_function", "call_method", "call_module"):
            return result
        if n.op == "call_module" and str(n.target) in SKIPPED_MODULES:
            return result
        args, kwargs = self.fetch_args_kwargs_from_env(n)
        if not any(isinstance(t, torch.Tensor) for t in pytree.tree_leaves((args, kwargs, result))):
            return result  # arithmetic on sizes: no device work
        key_target = n.target if n.op != "call_module" else callable_of(n, self.module)
        key = self.model.node_key(key_target, args, kwargs)
        stored = (self.model.cache.get(key, ("latency_s", "saved_bytes"))
                  or self.new_entries.get(key))
        if stored is None:
            try:
                seconds = self._time(n, args, kwargs)
            except torch.OutOfMemoryError:
                # Timing keeps the op's inputs, a clone per repeat and a cache-eviction buffer
                # alive at once; the op itself ran in the graph, so it is estimated instead.
                warnings.warn(f"autoopt: out of memory on {self.model.device} timing "
                              f"{n.name} ({op_name(n.target)}) alone; its cost is a roofline "
                              f"estimate instead. Profile with smaller inputs for a "
                              f"measurement.", stacklevel=2)
                return result
            except Exception as exc:  # noqa: BLE001 - an op that cannot rerun is estimated
                log.debug("cannot time %s alone: %s", n.format_node(), exc)
                return result
            saved = self._saved_bytes(n, args, kwargs) if self.training else 0
            stored = {"latency_s": seconds, "saved_bytes": saved}
            self.new_entries[key] = stored
        fn = callable_of(n, self.module)
        self.costs[n.name] = self.model.cost_of(n.name, key_target, fn, args, kwargs, result,
                                              stored["latency_s"], stored.get("saved_bytes", 0))
        return result

    def _call(self, n: Node, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        return getattr(self, n.op)(n.target, args, kwargs)

    def _time(self, n: Node, args: tuple[Any, ...], kwargs: dict[str, Any]) -> float:
        """Median time of the node alone, with the last-level-but-one cache evicted before
        each repeat: in a model run the weights, and the memory the result is written to, were
        last touched several layers ago, so a repeat must not find them left in cache by the
        repeat before."""
        variants = [(args, kwargs)]
        if mutates(n.target, args, kwargs):
            variants = [pytree.tree_map_only(torch.Tensor, clone_tensor, (args, kwargs))
                        for _ in range(_MUTATED_COPIES)]
        return median_seconds(lambda i: self._call(n, *variants[i % len(variants)]),
                              self.model.device, repeats=self.model.repeats,
                              before=self.model.evict_cache)

    def _saved_bytes(self, n: Node, args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
        if mutates(n.target, args, kwargs):  # one more run, which must not write the real ones
            args, kwargs = pytree.tree_map_only(torch.Tensor, clone_tensor, (args, kwargs))
        params = self._parameter_storages
        seen: set[int] = set()
        total = 0

        def pack(t: torch.Tensor) -> torch.Tensor:
            nonlocal total
            ptr = t.untyped_storage().data_ptr()
            if ptr not in params and ptr not in seen:
                seen.add(ptr)
                total += t.untyped_storage().nbytes()
            return t

        grad_args = pytree.tree_map_only(
            torch.Tensor, lambda t: t.detach().requires_grad_(t.is_floating_point())
            if not isinstance(t, torch.nn.Parameter) else t, (args, kwargs))
        try:
            with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                self._call(n, *grad_args)
        except Exception:  # noqa: BLE001 - ops that cannot run under autograd save nothing
            return 0
        return total


def clone_tensor(t: torch.Tensor) -> torch.Tensor:
    """A copy to run an op that writes its inputs on; a parameter is kept (no op writes it)."""
    return t.clone() if not isinstance(t, torch.nn.Parameter) else t


def mutates(target: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether timing the op repeatedly would write its real arguments (an in-place op,
    a train-mode BatchNorm's statistics), so it must run on copies."""
    return bool(written_arguments(target, args, kwargs))


def callable_of(node: Node, gm: GraphModule | None) -> Any:
    """What ``node`` calls: its function, its submodule, or its method as a function."""
    if node.op == "call_module" and gm is not None:
        return gm.get_submodule(str(node.target))
    if node.op == "call_method":
        return lambda self, *a, **k: getattr(self, str(node.target))(*a, **k)
    return node.target


def meta_value(node: Node) -> Any:
    """The fake (or example) value capture recorded for ``node``."""
    return node.meta.get("val", node.meta.get("example_value"))


def random_inputs(gm: GraphModule) -> list[Any]:
    """Values for ``gm``'s placeholders made from their metadata: floats random, integers zero."""
    values = []
    for node in gm.graph.nodes:
        if node.op != "placeholder":
            continue
        val = meta_value(node)
        if isinstance(val, torch.Tensor):
            shape = tuple(int(d) for d in val.shape)
            if val.is_floating_point():
                values.append(torch.randn(shape, dtype=val.dtype, device=val.device))
            else:
                values.append(torch.zeros(shape, dtype=val.dtype, device=val.device))
        else:
            values.append(val)
    return values
