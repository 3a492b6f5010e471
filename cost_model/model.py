"""The cost model passes read: ``estimate(node)``, ``profile(gm, inputs)``, ``predict(nodes)``.

Measured figures come from timing each node alone with its real inputs (``profile``); every
other figure is a roofline estimate calibrated by those measurements. Each figure says which.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import statistics
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.fx import GraphModule, Interpreter, Node
from torch.utils import _pytree as pytree

from .cache import CostCache, library_versions
from .device import DeviceInfo, device_info, eviction_bytes
from .estimate import (
    bound,
    count_flops,
    is_view,
    op_family,
    op_name,
    roofline_seconds,
    tensor_bytes,
    value_spec,
)
from .isolation import preserved, unwritten_inputs, written_arguments
from .timing import median_seconds, timed

log = logging.getLogger(__name__)

# A record's entries that are not a candidate's seconds start with this: ``_FAILED`` holds the
# candidates that failed when it was made, with why.
_NOTE = "#"
_FAILED = "#failed"

# Ops that write to their inputs run on clones, rotated so each repeat starts from fresh data.
_MUTATED_COPIES = 2
_SKIPPED_MODULES = ("_guards_fn",)


@dataclass(frozen=True)
class NodeCost:
    """One node's cost on the device.

    Args:
        node: the node's name in its graph.
        op: the op it calls (``aten.convolution.default``).
        latency_s: seconds per call.
        flops: floating-point operations.
        bytes: bytes read plus bytes written.
        output_bytes: bytes of its result (0 for views).
        saved_bytes: activation bytes autograd keeps for backward (measured when training).
        measured: True when ``latency_s`` was timed on the device, False when estimated.
        bound: ``compute``, ``memory`` or ``overhead``.
        in_model_s: seconds per call timed inside whole-graph runs (``profile(in_model=
            True)``), where the op finds the caches its neighbours leave; None if not timed.
    """

    node: str
    op: str
    latency_s: float
    flops: int = 0
    bytes: int = 0
    output_bytes: int = 0
    saved_bytes: int = 0
    measured: bool = False
    bound: str = "overhead"
    in_model_s: float | None = None

    @property
    def stage_s(self) -> float:
        """The figure to add up for a part of the graph (a pipeline stage): the in-model time
        where it was measured, else the node's own."""
        return self.in_model_s if self.in_model_s is not None else self.latency_s


@dataclass(frozen=True)
class GraphCost:
    """Costs of a graph (or a stage: a subset of its nodes), in execution order.

    Args:
        nodes: per-node costs.
        latency_s: predicted time of one run: the sum of the nodes' latencies.
        peak_activation_bytes: the most activation memory alive at once (parameters excluded).
        parameter_bytes: bytes of the parameters and buffers the nodes read.
        measured_fraction: share of ``latency_s`` that comes from measurements.
    """

    nodes: tuple[NodeCost, ...]
    latency_s: float
    peak_activation_bytes: int
    parameter_bytes: int
    measured_fraction: float
    saved_bytes: int = 0
    by_node: dict[str, NodeCost] = field(default_factory=dict, compare=False, repr=False)


class CostModel:
    """Costs of FX nodes on one device.

    Args:
        device: where the costs hold (``cpu``, ``cuda:0``).
        cache: where measurements persist; default ``~/.cache/autoopt/costs.json``.
        repeats: timed runs per node (the median is kept).
    """

    def __init__(self, device: str | torch.device = "cpu", cache: CostCache | None = None,
                 repeats: int = 7) -> None:
        self.device = torch.device(device)
        self.cache = cache if cache is not None else CostCache.default()
        self.repeats = repeats
        self._info: DeviceInfo | None = None
        self._scratch: torch.Tensor | None = None

    @property
    def info(self) -> DeviceInfo:
        """Device facts with measured ceilings (measured on first use, then cached)."""
        if self._info is None:
            self._info = device_info(self.device, cache=self.cache)
        return self._info

    def evict_cache(self, last_level: bool = False) -> None:
        """Overwrite a buffer twice the size of the L2 cache, so the next timed call starts
        cold; with ``last_level``, read one twice the size of the last-level cache (read, so
        that the timed call does not also pay for writing back what evicted its data, as a
        layer after a layer that only read its weights does not)."""
        size = eviction_bytes(self.device, last_level=last_level) // 4
        if self._scratch is None or self._scratch.numel() < size:
            self._scratch = torch.ones(size, dtype=torch.float32, device=self.device)
        if last_level:
            self._scratch[:size].sum()
        else:
            self._scratch[:size].fill_(1.0)

    # --- keys ------------------------------------------------------------------------------

    def _context(self) -> str:
        return f"{self.info.name}|{self.device.type}|threads={torch.get_num_threads()}|" \
               f"{library_versions()}"

    def node_key(self, target: Any, args: Any, kwargs: Any) -> str:
        return f"node|{op_name(target)}|{value_spec(args)}|{value_spec(kwargs)}|{self._context()}"

    def _calibration_key(self) -> str:
        return f"calibration|{self._context()}"

    # --- estimates -------------------------------------------------------------------------

    def estimate(self, node: Node, gm: GraphModule | None = None) -> NodeCost:
        """The node's cost from its metadata: a cached measurement if one exists for exactly
        this op, shapes, dtypes and device, else a calibrated roofline estimate."""
        if node.op not in ("call_function", "call_method", "call_module") or (
                node.op == "call_module" and str(node.target) in _SKIPPED_MODULES):
            return NodeCost(node.name, node.op, 0.0)
        args, kwargs = pytree.tree_map_only(Node, _meta_value, (node.args, node.kwargs))
        target = _callable(node, gm)
        output = _meta_value(node)
        if not any(isinstance(t, torch.Tensor) for t in pytree.tree_leaves((args, kwargs,
                                                                            output))):
            return NodeCost(node.name, op_name(node.target), 0.0)  # arithmetic on sizes
        return self._cost(node.name, node.target if node.op != "call_module" else target,
                          target, args, kwargs, output)

    def _cost(self, name: str, key_target: Any, fn: Any, args: Any, kwargs: Any, output: Any,
              measured_s: float | None = None, saved: int = 0) -> NodeCost:
        ceilings = self.info.ceilings
        assert ceilings is not None
        view = is_view(key_target)
        flops = 0 if view else count_flops(fn, args, kwargs) if callable(fn) else 0
        out_bytes = 0 if view else tensor_bytes(output)
        nbytes = 0 if view else tensor_bytes((args, kwargs)) + out_bytes
        label = op_name(key_target)
        key = self.node_key(key_target, args, kwargs)
        stored = self.cache.get(key, ("latency_s", "saved_bytes"))
        if measured_s is None and stored is not None:
            measured_s, saved = stored["latency_s"], stored.get("saved_bytes", saved)
        if measured_s is not None:
            seconds, measured = measured_s, True
        else:
            dtype = _first_dtype(args)
            seconds = roofline_seconds(flops, nbytes, dtype, ceilings, view)
            seconds *= self.calibration().get(op_family(label), 1.0) if not view else 1.0
            measured = False
        return NodeCost(name, label, seconds, flops, nbytes, out_bytes, saved, measured,
                        bound(flops, nbytes, seconds, ceilings))

    def calibration(self) -> dict[str, float]:
        """measured / roofline, per op family, from this device's earlier measurements."""
        return dict(self.cache.get(self._calibration_key(), ()) or {})

    # --- measurement -----------------------------------------------------------------------

    def profile(self, gm: GraphModule, example_inputs: Sequence[Any] | None = None, *,
                training: bool = False, in_model: bool = False) -> GraphCost:
        """Time every node alone with its real inputs (running the graph once to get them).

        Nodes already measured for the same op, shapes, dtypes and device are read from the
        cache. ``example_inputs`` are the graph's placeholders' values; without them random
        ones are made from the placeholders' metadata. With ``training`` the bytes each node
        saves for backward are measured too. With ``in_model`` each node is also timed inside
        whole-graph runs (``NodeCost.in_model_s``): alone, an op starts with cold caches; in the
        model it finds its input where its producer left it, which is what a pipeline stage's
        time adds up (``NodeCost.stage_s``). Those figures hold for this graph only and are not
        cached.

        The runs leave no trace: the graph's buffers (BatchNorm statistics, counters) and the
        RNG are as they were before, and inputs the graph writes in place are copied first.
        """
        with preserved(gm, example_inputs):
            inputs = (unwritten_inputs(gm, example_inputs) if example_inputs is not None
                      else _random_inputs(gm))
            profiler = _NodeProfiler(gm, self, training)
            with torch.no_grad() if not training else contextlib.nullcontext():
                profiler.run(*inputs)
        self.cache.put_many(profiler.new_entries)
        self._fit_calibration(profiler.costs, gm)
        costs = [profiler.costs.get(n.name) or self.estimate(n, gm) for n in gm.graph.nodes]
        if in_model:
            in_model_s = self._time_in_model(gm, inputs, training)
            costs = [dataclasses.replace(c, in_model_s=in_model_s.get(c.node, 0.0))
                     if c.latency_s > 0 or c.node in in_model_s else c for c in costs]
        return self.summarize(gm, costs)

    def _time_in_model(self, gm: GraphModule, inputs: list[Any], training: bool,
                       runs: int = 5) -> dict[str, float]:
        """Median seconds of each op node over ``runs`` whole-graph runs, each node timed as
        it runs in order: between clock reads (and device syncs) on a CPU, as its share of
        the stream's timeline on CUDA."""
        timer = _InModelTimer(gm, self.device)
        with preserved(gm, inputs), \
                torch.no_grad() if not training else contextlib.nullcontext():
            timer.run(*inputs)  # warm-up
            timer.samples.clear()
            timer.totals.clear()
            for _ in range(runs):
                timer.run(*inputs)
            if self.device.type == "cuda" and timer.totals:
                # The interpreter's own host work between nodes stretches a launch-bound
                # timeline; the graph's generated code has less. Scale the nodes' shares to
                # the graph's own run time, so stages add up to what the graph takes.
                whole = median_seconds(lambda i: gm(*inputs), self.device, warmup=1,
                                       repeats=runs)
                scale = whole / statistics.median(timer.totals)
                timer.samples = {n: [t * scale for t in s] for n, s in timer.samples.items()}
        return {name: statistics.median(s) for name, s in timer.samples.items()}

    def _fit_calibration(self, measured: dict[str, NodeCost], gm: GraphModule) -> None:
        ceilings = self.info.ceilings
        assert ceilings is not None
        ratios: dict[str, list[float]] = {}
        nodes = {n.name: n for n in gm.graph.nodes}
        for cost in measured.values():
            if not cost.measured or cost.latency_s <= 0:
                continue
            node = nodes.get(cost.node)
            view = node is not None and is_view(node.target)
            args = pytree.tree_map_only(Node, _meta_value, node.args) if node else ()
            roof = roofline_seconds(cost.flops, cost.bytes, _first_dtype(args), ceilings, view)
            ratios.setdefault(op_family(cost.op), []).append(cost.latency_s / roof)
        if not ratios:
            return
        old = self.calibration()
        fitted = {family: statistics.median(r) for family, r in ratios.items()}
        self.cache.put(self._calibration_key(), {**old, **fitted})

    def measure(self, fn: Any, args: Sequence[Any] = (), kwargs: dict[str, Any] | None = None,
                repeats: int = 21) -> float:
        """Median seconds of a whole call, e.g. a module's forward (the figure predictions
        are checked against). The calls leave ``fn`` (a module), the arguments and the RNG as
        they were."""
        # Copies of the arguments, which a forward may write (what it writes is not known).
        args, kwargs = pytree.tree_map_only(torch.Tensor, _clone, (tuple(args), kwargs or {}))
        with torch.no_grad(), preserved(*([fn] if isinstance(fn, torch.nn.Module) else [])):
            return median_seconds(lambda i: fn(*args, **kwargs), self.device, warmup=3,
                                  repeats=repeats, budget_s=10.0)

    def fastest(self, what: str, candidates: dict[str, Any], repeats: int = 3,
                state: Sequence[Any] = (), *, grad: bool = False,
                budget_s: float | None = None, cache_as: Iterable[str] | None = None,
                cold: bool = False, setup: Mapping[str, Callable[[], Any]] | None = None,
                ) -> tuple[str, dict[str, float]]:
        """Which of several equivalent kernels runs fastest here, and each one's seconds.

        ``candidates`` maps a kernel's name to a no-argument callable that runs it on real
        inputs; ``what`` names the op, shapes and dtypes they compute, and with the device and
        library versions keys the on-disk cache, so each choice is measured once per machine.
        Candidates are timed in interleaved rounds (a drifting machine then slows all alike)
        with caches evicted before each run; ties go to the first candidate. The runs leave
        the RNG, and ``state`` (modules, tensors the candidates may write), as they were.
        ``grad`` runs them with gradients enabled (a candidate that times a backward);
        ``budget_s`` stops after the round that spends it (at least three rounds).
        ``cache_as`` names the choice in the cache (default: the candidates): the candidates
        asked for, of which some could not be built, so that ``recorded`` finds it.
        ``cold`` evicts the last-level cache too: for a kernel whose operands will not be in
        cache when it runs (a layer's weights, where the model's weights are larger than the
        cache, come from memory on every call), which kernel is fastest can differ (a
        matrix-vector product: a kernel that streams memory well against one that computes
        well from cache). ``what`` names the regime too, so that a choice is not read back for
        the other one. ``setup[name]``, untimed before each run of that candidate, puts back
        what a run changes that the next one reads (inputs it writes: a decode step's cache
        positions, which would otherwise advance run after run past the cache's end).
        """
        names = list(cache_as) if cache_as is not None else list(candidates)
        stored = self.recorded(what, names)
        if stored is not None and set(stored) == set(candidates):
            seconds = stored
        else:
            samples: dict[str, list[float]] = {name: [] for name in candidates}
            mode = torch.enable_grad() if grad else torch.no_grad()
            with mode, preserved(*state):
                for name, fn in candidates.items():  # warm-up: first calls allocate, pack
                    if setup and name in setup:
                        setup[name]()
                    fn()
                spent = 0.0
                for round_ in range(repeats):
                    for name, fn in candidates.items():
                        evict = functools.partial(self.evict_cache, cold)
                        reset = (setup or {}).get(name)
                        samples[name].append(median_seconds(
                            lambda i, fn=fn: fn(), self.device, warmup=0, repeats=1,
                            before=evict if reset is None else
                            lambda evict=evict, reset=reset: (reset(), evict())))
                    spent += sum(s[-1] for s in samples.values())
                    if budget_s is not None and spent > budget_s and round_ >= 2:
                        break
            seconds = {name: statistics.median(s) for name, s in samples.items()}
            self.cache.put(self._fastest_key(what, names), seconds)
            if cold:
                # Twice the last-level cache (64 MiB here): not held for the module's life by
                # the cost model a re-capture keeps (issue 21: optimize's peak and held memory).
                self._scratch = None
        best = min(candidates, key=lambda name: (seconds[name], list(candidates).index(name)))
        return best, seconds

    def recorded(self, what: str, names: Iterable[str]) -> dict[str, float] | None:
        """The seconds ``fastest`` measured here for a choice among ``names`` (those of them
        that could be measured), if it did: a caller can then build the winner alone.

        A record that does not hold seconds (a damaged or hand-edited cache file: a string, a
        negative or infinite time) is ignored with a warning, and the choice measured again."""
        stored = self.cache.get(self._fastest_key(what, names))
        if not stored:
            return None
        seconds = [name for name in stored if not name.startswith(_NOTE)]
        if not set(seconds) <= set(names):
            return None
        stored = self.cache.get(self._fastest_key(what, names), seconds)
        return {name: float(stored[name]) for name in seconds} if stored else None

    def recorded_failures(self, what: str, names: Iterable[str]) -> dict[str, str]:
        """The candidates of a choice ``record`` stored that failed then, with why."""
        stored = self.cache.get(self._fastest_key(what, names)) or {}
        failed = stored.get(_FAILED)
        return {str(k): str(v) for k, v in failed.items()} if isinstance(failed, dict) else {}

    def record(self, what: str, names: Iterable[str], seconds: Mapping[str, float],
               failed: Mapping[str, str] | None = None) -> None:
        """Store a choice among ``names`` measured in several sessions (each candidate against
        one yardstick, its seconds put on one scale), for ``recorded`` to find; ``failed``:
        candidates that could not be built or measured, with why (``recorded_failures``)."""
        entry: dict[str, Any] = {k: float(v) for k, v in seconds.items()}
        if failed:
            entry[_FAILED] = dict(failed)
        self.cache.put(self._fastest_key(what, names), entry)

    def _fastest_key(self, what: str, names: Iterable[str]) -> str:
        return f"fastest|{what}|{sorted(names)}|{self._context()}"

    # --- whole graphs and stages -----------------------------------------------------------

    def predict(self, gm: GraphModule, nodes: Iterable[Node] | None = None) -> GraphCost:
        """Predicted cost of ``nodes`` (default: the whole graph) from estimates."""
        chosen = list(gm.graph.nodes) if nodes is None else list(nodes)
        return self.summarize(gm, [self.estimate(n, gm) for n in chosen], chosen)

    def summarize(self, gm: GraphModule, costs: Sequence[NodeCost],
                  nodes: Sequence[Node] | None = None) -> GraphCost:
        nodes = list(gm.graph.nodes) if nodes is None else list(nodes)
        total = sum(c.latency_s for c in costs)
        measured = sum(c.latency_s for c in costs if c.measured)
        return GraphCost(tuple(costs), total, peak_activation_bytes(nodes),
                         parameter_bytes(gm, nodes), measured / total if total else 0.0,
                         sum(c.saved_bytes for c in costs), {c.node: c for c in costs})


class _InModelTimer(Interpreter):
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


class _NodeProfiler(Interpreter):
    """Runs the graph once; times each op node alone on its real inputs as it goes."""

    def __init__(self, gm: GraphModule, model: CostModel, training: bool) -> None:
        super().__init__(gm)
        self.model = model
        self.training = training
        self.costs: dict[str, NodeCost] = {}
        self.new_entries: dict[str, dict[str, Any]] = {}
        # Parameters are held for backward by reference, not as new memory: not counted.
        self._parameter_storages = {t.data_ptr() for t in gm.parameters()} if training else set()

    def run_node(self, n: Node) -> Any:
        result = super().run_node(n)
        if n.op not in ("call_function", "call_method", "call_module"):
            return result
        if n.op == "call_module" and str(n.target) in _SKIPPED_MODULES:
            return result
        args, kwargs = self.fetch_args_kwargs_from_env(n)
        if not any(isinstance(t, torch.Tensor) for t in pytree.tree_leaves((args, kwargs, result))):
            return result  # arithmetic on sizes: no device work
        key_target = n.target if n.op != "call_module" else _callable(n, self.module)
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
        fn = _callable(n, self.module)
        self.costs[n.name] = self.model._cost(n.name, key_target, fn, args, kwargs, result,
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
        if _mutates(n.target, args, kwargs):
            variants = [pytree.tree_map_only(torch.Tensor, _clone, (args, kwargs))
                        for _ in range(_MUTATED_COPIES)]
        return median_seconds(lambda i: self._call(n, *variants[i % len(variants)]),
                              self.model.device, repeats=self.model.repeats,
                              before=self.model.evict_cache)

    def _saved_bytes(self, n: Node, args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
        if _mutates(n.target, args, kwargs):  # one more run, which must not write the real ones
            args, kwargs = pytree.tree_map_only(torch.Tensor, _clone, (args, kwargs))
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


def _clone(t: torch.Tensor) -> torch.Tensor:
    return t.clone() if not isinstance(t, torch.nn.Parameter) else t


def _mutates(target: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether timing the op repeatedly would write its real arguments (an in-place op,
    a train-mode BatchNorm's statistics), so it must run on copies."""
    return bool(written_arguments(target, args, kwargs))


def _callable(node: Node, gm: GraphModule | None) -> Any:
    if node.op == "call_module" and gm is not None:
        return gm.get_submodule(str(node.target))
    if node.op == "call_method":
        return lambda self, *a, **k: getattr(self, str(node.target))(*a, **k)
    return node.target


def _meta_value(node: Node) -> Any:
    return node.meta.get("val", node.meta.get("example_value"))


def _first_dtype(args: Any) -> torch.dtype | None:
    for leaf in pytree.tree_leaves(args):
        if isinstance(leaf, torch.Tensor):
            return leaf.dtype
    return None


def _random_inputs(gm: GraphModule) -> list[Any]:
    values = []
    for node in gm.graph.nodes:
        if node.op != "placeholder":
            continue
        val = _meta_value(node)
        if isinstance(val, torch.Tensor):
            shape = tuple(int(d) for d in val.shape)
            if val.is_floating_point():
                values.append(torch.randn(shape, dtype=val.dtype, device=val.device))
            else:
                values.append(torch.zeros(shape, dtype=val.dtype, device=val.device))
        else:
            values.append(val)
    return values


def peak_activation_bytes(nodes: Sequence[Node]) -> int:
    """Most bytes of node results alive at once, walking ``nodes`` in order (views share
    their base's memory; parameters are not activations)."""
    position = {n: i for i, n in enumerate(nodes)}
    last_use: dict[Node, int] = {}
    for n in nodes:
        for user in n.users:
            if user in position:
                last_use[n] = max(last_use.get(n, 0), position[user])
    live: dict[Node, int] = {}
    peak = current = 0
    for i, n in enumerate(nodes):
        if n.op in ("call_function", "call_method", "call_module", "placeholder") and not (
                n.op != "placeholder" and is_view(n.target)):
            size = tensor_bytes(_meta_value(n))
            live[n] = size
            current += size
            peak = max(peak, current)
        for dead in [m for m in live if last_use.get(m, i) <= i]:
            current -= live.pop(dead)
    return peak


def parameter_bytes(gm: GraphModule, nodes: Sequence[Node]) -> int:
    seen: set[int] = set()
    total = 0
    for n in nodes:
        if n.op == "get_attr":
            value = _meta_value(n)
            if isinstance(value, torch.Tensor):
                try:
                    real = gm.get_parameter(str(n.target))
                except AttributeError:
                    try:
                        real = gm.get_buffer(str(n.target))
                    except AttributeError:
                        real = value
                if id(real) not in seen:
                    seen.add(id(real))
                    total += real.numel() * real.element_size()
        elif n.op == "call_module" and gm is not None and str(n.target) not in _SKIPPED_MODULES:
            for p in gm.get_submodule(str(n.target)).parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    total += p.numel() * p.element_size()
    return total
