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
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.fx import GraphModule, Node
from torch.utils import _pytree as pytree

from .cache import CostCache, library_versions
from .contention import Watch, undecided
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
from .isolation import preserved, unwritten_inputs
from .profiler import (
    SKIPPED_MODULES,
    InModelTimer,
    NodeProfiler,
    callable_of,
    clone_tensor,
    meta_value,
    random_inputs,
)
from .timing import median_seconds

log = logging.getLogger(__name__)

# A record's entries that are not a candidate's seconds start with this: ``_FAILED`` holds the
# candidates that failed when it was made, with why.
_NOTE = "#"
_FAILED = "#failed"
# Why a record's times may not be this machine's own (it was shared while they were taken).
_SHARED = "#shared"



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
        # Why the last ``fastest`` measurement may not be this machine's own, or "".
        self.last_sharing = ""

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
                node.op == "call_module" and str(node.target) in SKIPPED_MODULES):
            return NodeCost(node.name, node.op, 0.0)
        args, kwargs = pytree.tree_map_only(Node, meta_value, (node.args, node.kwargs))
        target = callable_of(node, gm)
        output = meta_value(node)
        if not any(isinstance(t, torch.Tensor) for t in pytree.tree_leaves((args, kwargs,
                                                                            output))):
            return NodeCost(node.name, op_name(node.target), 0.0)  # arithmetic on sizes
        return self.cost_of(node.name, node.target if node.op != "call_module" else target,
                          target, args, kwargs, output)

    def cost_of(self, name: str, key_target: Any, fn: Any, args: Any, kwargs: Any, output: Any,
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
                      else random_inputs(gm))
            profiler = NodeProfiler(gm, self, training)
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
        timer = InModelTimer(gm, self.device)
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
            args = pytree.tree_map_only(Node, meta_value, node.args) if node else ()
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
        args, kwargs = pytree.tree_map_only(torch.Tensor, clone_tensor, (tuple(args), kwargs or {}))
        with torch.no_grad(), preserved(*([fn] if isinstance(fn, torch.nn.Module) else [])):
            return median_seconds(lambda i: fn(*args, **kwargs), self.device, warmup=3,
                                  repeats=repeats, budget_s=10.0)

    def fastest(self, what: str, candidates: dict[str, Any], repeats: int = 3,
                state: Sequence[Any] = (), *, grad: bool = False,
                budget_s: float | None = None, cache_as: Iterable[str] | None = None,
                cold: bool = False, setup: Mapping[str, Callable[[], Any]] | None = None,
                floor_s: float | None = None) -> tuple[str, dict[str, float]]:
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

        Where the rounds do not decide (a candidate's runs disagree widely, the two fastest lie
        within that disagreement, other processes held the cores this one needed, or a time
        is below ``floor_s``, the least the work takes at this machine's measured peak) the
        rounds are run again and all samples count. A second measurement still taken on a
        shared machine, or still below the floor, says so in ``last_sharing`` and in its
        record, which ``recorded`` then does not serve: the next ``optimize`` measures again.
        """
        names = list(cache_as) if cache_as is not None else list(candidates)
        stored = self.recorded(what, names)
        self.last_sharing = ""
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
                for attempt in range(2):
                    with Watch() as watch:
                        self._rounds(candidates, samples, repeats, budget_s, cold, setup)
                    doubt = self._doubt(samples, watch, floor_s)
                    why = doubt or undecided(samples)
                    if attempt == 0 and why:
                        log.info("cost model: measuring %s again: %s", what, why)
                        continue
                    break
            seconds = {name: statistics.median(s) for name, s in samples.items()}
            entry: dict[str, Any] = dict(seconds)
            if doubt:  # still, after a second measurement: not this machine's own times
                self.last_sharing = doubt
                entry[_SHARED] = doubt
            self.cache.put(self._fastest_key(what, names), entry)
            if cold:
                # Twice the last-level cache (64 MiB here): not held for the module's life by
                # the cost model a re-capture keeps (issue 21: optimize's peak and held memory).
                self._scratch = None
        best = min(candidates, key=lambda name: (seconds[name], list(candidates).index(name)))
        return best, seconds

    def _rounds(self, candidates: dict[str, Any], samples: dict[str, list[float]],
                repeats: int, budget_s: float | None, cold: bool,
                setup: Mapping[str, Callable[[], Any]] | None) -> None:
        """Interleaved rounds, one run of each candidate per round, appended to ``samples``."""
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

    def _doubt(self, samples: dict[str, list[float]], watch: Watch,
               floor_s: float | None) -> str:
        """Why the samples may not hold the candidates' times here (the machine was shared,
        or a time is below the floor), or ""."""
        if self.device.type == "cpu" and watch.sharing is not None and watch.sharing.shared:
            return f"the CPU was shared: {watch.sharing.describe()}"
        if floor_s:
            low = {n: statistics.median(s) for n, s in samples.items()
                   if s and statistics.median(s) < floor_s}
            if low:
                name, seconds = min(low.items(), key=lambda item: item[1])
                return (f"{name} measured {seconds * 1e3:.3g} ms, below the "
                        f"{floor_s * 1e3:.3g} ms its work takes at this machine's peak")
        return ""

    def recorded(self, what: str, names: Iterable[str]) -> dict[str, float] | None:
        """The seconds ``fastest`` measured here for a choice among ``names`` (those of them
        that could be measured), if it did: a caller can then build the winner alone.

        A record that does not hold seconds (a damaged or hand-edited cache file: a string, a
        negative or infinite time) is ignored with a warning, and the choice measured again."""
        stored = self.cache.get(self._fastest_key(what, names))
        if not stored:
            return None
        if _SHARED in stored:  # measured while other processes held the cores: again
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
               failed: Mapping[str, str] | None = None, shared: str = "") -> None:
        """Store a choice among ``names`` measured in several sessions (each candidate against
        one yardstick, its seconds put on one scale), for ``recorded`` to find; ``failed``:
        candidates that could not be built or measured, with why (``recorded_failures``);
        ``shared``: why the times may not be this machine's own (``recorded`` then serves
        none of it)."""
        entry: dict[str, Any] = {k: float(v) for k, v in seconds.items()}
        if failed:
            entry[_FAILED] = dict(failed)
        if shared:
            entry[_SHARED] = shared
        self.cache.put(self._fastest_key(what, names), entry)

    def _fastest_key(self, what: str, names: Iterable[str]) -> str:
        return f"fastest|{what}|{sorted(names)}|{self._context()}"

    # --- choices on graphs of one kind -------------------------------------------------------

    def similar(self, kind: str) -> list[dict[str, Any]]:
        """The choices ``remember_similar`` stored here (this device, thread count, library
        versions) for graphs of ``kind``, oldest first; entries that are not mappings (a
        hand-edited file) are left out."""
        entry = self.cache.get(self._similar_key(kind)) or {}
        choices = entry.get("choices") if isinstance(entry, dict) else None
        return [c for c in choices if isinstance(c, dict)] if isinstance(choices, list) else []

    def remember_similar(self, kind: str, choice: dict[str, Any], keep: int = 8) -> None:
        """Store one graph's measured choice among graphs of ``kind`` (the latest ``keep``; a
        graph measured again replaces its earlier entry, named by ``choice["graph"]``)."""
        kept = [c for c in self.similar(kind) if c.get("graph") != choice.get("graph")]
        self.cache.put(self._similar_key(kind), {"choices": [*kept, choice][-keep:]})

    def _similar_key(self, kind: str) -> str:
        return f"similar|{kind}|{self._context()}"

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


def _first_dtype(args: Any) -> torch.dtype | None:
    for leaf in pytree.tree_leaves(args):
        if isinstance(leaf, torch.Tensor):
            return leaf.dtype
    return None


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
            size = tensor_bytes(meta_value(n))
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
            value = meta_value(n)
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
        elif n.op == "call_module" and gm is not None and str(n.target) not in SKIPPED_MODULES:
            for p in gm.get_submodule(str(n.target)).parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    total += p.numel() * p.element_size()
    return total
