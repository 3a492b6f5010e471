"""The ``hybrid`` backend: Inductor's generated kernels for the regions between autoopt's own.

The two whole-graph backends each lose half of a graph. ``aten`` runs autoopt's measured
kernels (packed linears on whichever of ATen, MKL and oneDNN measured fastest for the shape,
oneDNN convolutions) but every op between them as its own kernel, a pass over memory each;
``inductor`` fuses everything but lowers the GEMMs its own way (fp32 linears through MKL on a
CPU: 2.1–2.3× slower than oneDNN on an AMD EPYC). ``hybrid`` hands Inductor the graph after
autoopt's lowerings, each of autoopt's kernel calls turned into an opaque op
(``autoopt::kernel``) that Inductor calls and does not look into, so Inductor generates the
regions between them::

    [embedding, rmsnorm] → onednn_linear → [rope, cache write, repeat_kv] → sdpa →
    onednn_linear → [residual add, rmsnorm] → onednn_linear → [silu × mul] → …

Measured on an AMD EPYC at 1 thread, a Llama-style ~100M decoder's decode step: 12.8 ms
against 14.4 (aten) and 24.6 (inductor).

The opaque op is a plain ``torch.library`` op with a Python kernel (2.8 µs a call;
``torch.library.custom_op`` costs 55 µs): ``kernel(tensors, index, what)`` calls the
``index``-th kernel of the graph being run, from a table the graph's wrapper sets for the
duration of each call (per thread). The generated code thus names no process-bound object, so
Inductor's on-disk cache serves the next ``optimize`` of the same graph (the compile is most
of hybrid's setup); ``what`` (the kernel, its weight's shape, what it returns) keeps graphs
that call different kernels apart in that cache. The op's shape function returns what the
graph recorded for the call where sizes are static, else runs the kernel on fake tensors
(autoopt's kernels support them). Inference only: the op has no gradient (autoopt's packed
kernels are inference lowerings anyway).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.fx._pytree as fx_pytree
from torch.fx import GraphModule, Node
from torch.fx.graph import CodeGen
from torch.utils import _pytree as pytree

from autoopt.backends import inductor
from autoopt.backends.base import Backend, Lowering, Subgraph, WholeGraph
from autoopt.check.inputs import clone_inputs
from autoopt.check.state import preserved
from autoopt.passes.graph import copy_graph_module

# The kernel table of the graph this thread is running (or compiling): the op's ``index``
# points into it. Each entry: the kernel, its arguments with each tensor an index into the
# op's tensor list, what it returns where the graph's sizes are static.
log = logging.getLogger(__name__)
_RUNNING = threading.local()
_DEFINE = threading.Lock()
_OP: Any = None


def opaque_nodes(gm: GraphModule) -> list[Node]:
    """The calls Inductor cannot lower and keeps as they are: autoopt's kernel objects, and
    ops that read an opaque constant (a packed weight with no storage, a packed-params
    object)."""
    return [node for node in gm.graph.nodes if node.op == "call_function" and (
        not isinstance(node.target, torch._ops.OpOverload | torch._ops.OpOverloadPacket)
        and getattr(node.target, "__module__", "").startswith("autoopt.")
        or any(_opaque_constant(gm, a) for a in node.all_input_nodes))]


def kernel_nodes(gm: GraphModule) -> list[Node]:
    """autoopt's kernels in ``gm``: the opaque calls, and the ops of autoopt's own C++ kernels
    (``autoopt_blocks``: quantized linears, decode attention), which Inductor calls as they
    are. A graph with either is hybrid's: compiled without Dynamo and without freezing (the
    int4 decode step of a Llama-style model, 3.8 ms there, 8.0 through the inductor
    backend)."""
    opaque = set(opaque_nodes(gm))
    return [node for node in gm.graph.nodes if node in opaque or (
        node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload)
        and node.target.namespace == "autoopt_blocks")]


# How far the estimated share of aten's time in its kernels may overstate it: BERT-base at
# batch 1 (share 0.90 estimated, 2 vCPUs) was ruled out at aten's time times 0.90 in one run
# and measured faster than OpenVINO in another.
_SLACK = 0.1


class _AtBest:
    """The least time over eager's ``hybrid`` can take: it runs aten's graph with the same
    autoopt kernels, so at best the regions between them take no time, leaving aten's time
    times the kernels' share of it (the cost model's estimate of each node: measured where
    it was, else its roofline; a kernel's roofline is its peak's time, which understates its
    share and so the bound). Measured on resnet18 at batch 1, 2 vCPUs: an estimated share of
    0.98, hybrid 37.0 ms against aten's 34.6; mobilenet_v3_large 0.37, 9.8 against 10.1."""

    reads = "aten"  # the candidate whose time the bound is a share of

    def __init__(self, graph: WholeGraph) -> None:
        self.graph = graph
        self._share: float | None = None

    def share(self) -> float | None:
        if self._share is None and self.graph.cost_model is not None:
            try:
                kept = {node.name for node in kernel_nodes(self.graph.gm)}
                costs = self.graph.cost_model.predict(self.graph.gm).nodes
            except Exception:  # noqa: BLE001 - without the estimate hybrid is built
                return None
            total = sum(c.latency_s for c in costs)
            self._share = sum(c.latency_s for c in costs if c.node in kept) / total \
                if total > 0 else 0.0
        return self._share

    def __call__(self, ratios: Mapping[str, float]) -> tuple[float, str] | None:
        # A dynamic graph's estimate would read its symbolic sizes: no bound there.
        share = self.share() if "aten" in ratios and not self.graph.dynamic else None
        if share is None:
            return None
        kept = share * (1.0 - _SLACK)
        return ratios["aten"] * kept, (f"aten's time less all of the regions between its "
                                       f"kernels, which take {1 - share:.0%} of it by the "
                                       f"cost model's estimate, less {_SLACK:.0%} more for "
                                       f"that estimate's error")


def regions(gm: GraphModule) -> str:
    """The regions, for the report: autoopt's kernels by name and how many connected pieces
    of the graph Inductor generates between them."""
    kernels = set(kernel_nodes(gm))
    names: dict[str, int] = {}
    for node in kernels:
        name = str(node.target.overloadpacket) if isinstance(node.target, torch._ops.OpOverload) \
            else getattr(node.target, "__name__", str(node.target))
        names[name] = names.get(name, 0) + 1
    compute = [n for n in gm.graph.nodes if n.op == "call_function" and n not in kernels]
    parent = {n: n for n in compute}

    def root(n: Node) -> Node:
        while parent[n] is not n:
            parent[n] = parent[parent[n]]
            n = parent[n]
        return n

    for node in compute:
        for other in node.all_input_nodes:
            if other in parent:
                parent[root(other)] = root(node)
    pieces = len({root(n) for n in compute})
    listed = ", ".join(f"{name} ×{count}" for name, count in sorted(names.items()))
    return f"autoopt's kernels: {listed}; {pieces} region(s) generated by Inductor"


def lower(gm: GraphModule, example: tuple[tuple[Any, ...], dict[str, Any]] | None, *,
          dynamic: bool, settings: dict[str, Any] | None = None) -> inductor.InductorGraph:
    """``gm`` (after autoopt's lowerings) compiled by Inductor around its opaque kernel calls.

    A static graph whose inputs are ``example`` (``(args, kwargs)``) is compiled here without
    Dynamo, whose guards cost 0.3 ms a call on a decode step of 500 inputs (the optimized
    module checks the inputs already). A graph with symbolic sizes, or with no example (its
    inputs are not the model's), goes through ``torch.compile`` and compiles on its first
    call. Weights are not frozen: the graph reads the user's (and autoopt's packed copies).
    """
    inductor.quiet_cpp_extension()
    graph = copy_graph_module(gm)
    table = _opaque_to_op(graph)
    options = {"freezing": False, **inductor.config_of(settings, dynamic)}
    if dynamic and example is not None:  # the layouts, which sizes the kernels compute
        _observe_layouts(graph, table, *example, orders_only=True)
    if dynamic or example is None:
        return inductor.InductorGraph(_with_table(table, torch.compile(  # see inductor.lower
            graph.forward, backend="inductor", fullgraph=True, dynamic=dynamic,
            options=options)))
    return _compile_static(graph, table, example, options, gm)


def _compile_static(graph: GraphModule, table: list[_Kernel],
                    example: tuple[tuple[Any, ...], dict[str, Any]],
                    options: dict[str, Any], aten: GraphModule) -> inductor.InductorGraph:
    """Compiled for the example's sizes and layouts. The generated code asserts each input's
    strides, and a call's signature does not name them: an input laid out otherwise (a
    channels-last image, a transposed or sliced tensor, ids cut from a longer batch) raised
    Inductor's assertion. Such a call runs ``aten``, the graph the kernels came from."""
    from torch._guards import TracingContext, tracing
    from torch._inductor import config as inductor_config
    from torch._inductor.codecache import PyCodeCache
    from torch._inductor.compile_fx import compile_fx
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    info = getattr(graph.graph._codegen, "pytree_info", None)
    if info is not None:  # torch.export's graph takes (args, kwargs): compile the flat one
        graph.graph._codegen = CodeGen()
        graph.recompile()
        flat = fx_pytree.tree_flatten_spec(example, info.in_spec)
    else:
        flat = list(example[0])
    _observe_layouts(graph, table, flat, {})
    # Fake inputs with a shape environment, as Dynamo hands them over: without one Inductor
    # bypasses its on-disk cache ("No shape env") and compiles again in every process.
    fake_mode = FakeTensorMode(shape_env=ShapeEnv())
    fakes = [fake_mode.from_tensor(x, static_shapes=True) if isinstance(x, torch.Tensor)
             else x for x in flat]
    # The call's signature and ``_Layouts`` check each input's sizes and strides before the
    # generated code runs, and each opaque kernel's result is laid out as a real run showed
    # (``_observe_layouts``): Inductor's own asserts of both, in Python, were ~200 a decode
    # step (0.15 ms of a 3.8 ms int4 step of the Llama-style model).
    options = {"size_asserts": False, **options}
    before = len(PyCodeCache.modules)
    with inductor_config.patch(options), tracing(TracingContext(fake_mode)), \
            _running(table):
        inner = compile_fx(graph, fakes)
    loaded = PyCodeCache.modules[before:]
    layouts = _Layouts(flat)
    if info is None:
        def flat_call(*args: Any) -> Any:
            return inner(*args) if layouts.match(args) else layouts.other(aten, args, {})
        return inductor.InductorGraph(_with_table(table, flat_call), loaded)
    in_spec, out_spec = info.in_spec, info.out_spec

    def call(*args: Any, **kwargs: Any) -> Any:
        flat_args = fx_pytree.tree_flatten_spec((args, kwargs), in_spec)
        if not layouts.match(flat_args):
            return layouts.other(aten, args, kwargs)
        outputs = inner(*flat_args)
        return pytree.tree_unflatten(outputs, out_spec) if out_spec is not None else outputs
    return inductor.InductorGraph(_with_table(table, call), loaded)


class _Layouts:
    """The example inputs' layouts, checked on a call: a contiguous one by the tensor's flag
    (fast: a decode step has hundreds of inputs; like Inductor's assertion, it ignores the
    strides of dimensions of size 1), another by its strides."""

    def __init__(self, flat: list[Any]) -> None:
        self.contiguous = [i for i, x in enumerate(flat)
                           if isinstance(x, torch.Tensor) and x.is_contiguous()]
        self.strided = [(i, x.stride()) for i, x in enumerate(flat)
                        if isinstance(x, torch.Tensor) and not x.is_contiguous()]
        self.said = False

    def match(self, flat: Any) -> bool:
        return all(flat[i].is_contiguous() for i in self.contiguous) and all(
            flat[i].stride() == stride for i, stride in self.strided)

    def other(self, aten: GraphModule, args: Any, kwargs: dict[str, Any]) -> Any:
        if not self.said:
            self.said = True
            log.info("hybrid: an input laid out unlike the example (its strides) runs the "
                     "aten graph, which takes any layout")
        return aten(*args, **kwargs)


def _observe_layouts(graph: GraphModule, table: list[_Kernel], args: Any,
                     kwargs: dict[str, Any], *, orders_only: bool = False) -> None:
    """Each kernel's result as it really is, from one run of the graph on (copies of) the
    example inputs: the graph's record can name another layout than the kernel returns
    (oneDNN's convolutions answer in channels-last), and the generated code asserts the
    layout it was compiled for. With ``orders_only`` (symbolic sizes) only the order of
    each result's dimensions in memory is kept; the kernel computes the sizes."""
    args, kwargs = pytree.tree_map_only(torch.Tensor, lambda x: x.detach().clone(),
                                        (tuple(args), dict(kwargs)))
    _RUNNING.observed = {}
    try:
        # The run leaves no trace: a train-mode graph writes BatchNorm statistics (the
        # module's own buffers, which the graph shares), a dropout draws from the RNG.
        with torch.no_grad(), preserved(graph), _running(table):
            graph(*args, **kwargs)
        for index, result in _RUNNING.observed.items():
            target, arguments, _ = table[index]
            table[index] = (target, arguments, _Order.of(result) if orders_only else result)
    finally:
        del _RUNNING.observed
    for node in graph.graph.nodes:  # "what" names the result as observed (the cache's key)
        if node.op == "call_function" and node.target is _OP[1]:
            tensors, index, _ = node.args
            node.args = (tensors, index, _what(table[index]))
    graph.recompile()


class _running:  # noqa: N801 - a context manager used like a function
    """This thread runs (or compiles) the graph whose kernels are ``table``."""

    def __init__(self, table: list[_Kernel]) -> None:
        self.table = table

    def __enter__(self) -> None:
        self.previous = getattr(_RUNNING, "table", None)
        _RUNNING.table = self.table

    def __exit__(self, *exc: Any) -> None:
        _RUNNING.table = self.previous


def _with_table(table: list[_Kernel], run: Callable[..., Any]) -> Callable[..., Any]:
    def call(*args: Any, **kwargs: Any) -> Any:
        with _running(table):
            return run(*args, **kwargs)
    return call


def _opaque_to_op(gm: GraphModule) -> list[_Kernel]:
    """Each opaque call in ``gm`` replaced by ``autoopt::kernel(tensors, index, what)``; the
    table of the kernels, in index order."""
    op = _kernel_op()
    table: list[_Kernel] = []
    for node in opaque_nodes(gm):
        tensors, arguments = _template(gm, node)
        table.append((node.target, arguments, _static_result(node)))
        with gm.graph.inserting_before(node):
            new = gm.graph.call_function(op, (tensors, len(table) - 1, _what(table[-1])))
        new.meta = dict(node.meta)
        node.replace_all_uses_with(new)
        gm.graph.erase_node(node)
    gm.graph.eliminate_dead_code()
    gm.recompile()
    return table


def _what(kernel: _Kernel) -> str:
    target, _, result = kernel
    return f"{getattr(target, '__qualname__', target)}->{result}"


def _template(gm: GraphModule, node: Node) -> tuple[list[Node], _Arguments]:
    """The tensors a call reads, and its arguments with each of them an index into that
    list, opaque constants bound by value."""
    tensors: list[Node] = []

    def slot(a: Any) -> Any:
        if not isinstance(a, Node):
            return a
        if _opaque_constant(gm, a):  # bound into the call, not an input Inductor sees
            return _fetch(gm, a.target)
        tensors.append(a)
        return _Slot(len(tensors) - 1)

    args, kwargs = torch.fx.node.map_aggregate((node.args, node.kwargs), slot)
    return tensors, _Arguments(tuple(args), dict(kwargs))


_Kernel = tuple[Callable[..., Any], "_Arguments", "tuple[Any, ...] | _Order | None"]


class _Order(tuple):
    """A result's dimensions from outermost to innermost in memory, where its sizes are
    symbolic (``torch.empty_permuted``'s physical layout)."""

    @classmethod
    def of(cls, result: tuple[Any, ...]) -> _Order:
        shape, stride, _, _ = result
        return cls(sorted(range(len(shape)), key=lambda d: (-stride[d], d)))


class _Slot(int):
    """An index into the op's tensor list, in a call's argument template."""


class _Arguments:
    """A call's arguments with its tensors taken out; ``fill(tensors)`` puts them back (a
    few list assignments where the arguments are flat, as a linear's are: this runs on every
    call, 33 times a decode step)."""

    def __init__(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self.args, self.kwargs = args, kwargs
        self.flat = not any(isinstance(a, tuple | list | dict)
                            for a in (*args, *kwargs.values()))
        self.slots = [(i, a) for i, a in enumerate(args) if type(a) is _Slot]
        self.keyword_slots = [(k, a) for k, a in kwargs.items() if type(a) is _Slot]

    def fill(self, tensors: list[torch.Tensor | None]) -> tuple[list[Any], dict[str, Any]]:
        if not self.flat:
            return _filled(self.args, tensors), _filled(self.kwargs, tensors)
        args = list(self.args)
        for i, index in self.slots:
            args[i] = tensors[index]
        if not self.keyword_slots:
            return args, self.kwargs
        kwargs = dict(self.kwargs)
        for key, index in self.keyword_slots:
            kwargs[key] = tensors[index]
        return args, kwargs


def _filled(value: Any, tensors: list[torch.Tensor | None]) -> Any:
    if type(value) is _Slot:
        return tensors[value]
    if isinstance(value, tuple | list):
        return type(value)(_filled(x, tensors) for x in value)
    if isinstance(value, dict):
        return {k: _filled(v, tensors) for k, v in value.items()}
    return value


def _static_result(node: Node) -> tuple[Any, ...] | None:
    value = node.meta.get("val")
    if not isinstance(value, torch.Tensor) or not all(
            isinstance(n, int) for n in (*value.shape, *value.stride())):
        return None
    return tuple(value.shape), value.stride(), value.dtype, value.device


def _fake(tensors: list[torch.Tensor | None], index: int, what: str) -> Any:
    """The op's result on fake tensors: as recorded in the graph where its sizes are static
    (a quantized kernel's packed-params object cannot meet fake tensors), else the kernel's
    own shape computation."""
    result = _RUNNING.table[index][2]
    if result is None:
        return _call(tensors, index, what)
    if isinstance(result, _Order):
        out = _call(tensors, index, what)
        return torch.empty_permuted(out.shape, result, dtype=out.dtype, device=out.device)
    shape, stride, dtype, device = result
    return torch.empty_strided(shape, stride, dtype=dtype, device=device)


def _call(tensors: list[torch.Tensor | None], index: int, what: str) -> Any:
    target, arguments, _ = _RUNNING.table[index]
    args, kwargs = arguments.fill(tensors)
    result = target(*args, **kwargs)
    observed = getattr(_RUNNING, "observed", None)
    if observed is not None and isinstance(result, torch.Tensor):
        observed[index] = (tuple(result.shape), result.stride(), result.dtype, result.device)
    return result


def _kernel_op() -> Any:
    global _OP
    with _DEFINE:
        if _OP is None:
            library = torch.library.Library("autoopt", "DEF")
            # Exact strides: the tensors reach a kernel laid out as in eager (Inductor would
            # otherwise pick its own layouts), so that each kernel returns the layout it was
            # seen to return (a oneDNN convolution's output follows its input's).
            library.define("kernel(Tensor?[] tensors, int index, str what) -> Tensor",
                           tags=(torch.Tag.needs_exact_strides,))
            # CompositeExplicitAutograd: the Python kernel is called straight from the
            # dispatcher (and is the op's meaning on every backend)
            library.impl("kernel", _call, "CompositeExplicitAutograd")
            torch.library.register_fake("autoopt::kernel", _fake, lib=library)
            _OP = (library, torch.ops.autoopt.kernel.default)
    return _OP[1]


def _fetch(gm: GraphModule, target: str) -> Any:
    value: Any = gm
    for part in target.split("."):
        value = getattr(value, part)
    return value


def _opaque_constant(gm: GraphModule, node: Node) -> bool:
    if node.op != "get_attr":
        return False
    value = _fetch(gm, node.target)
    return isinstance(value, torch.ScriptObject) or (
        isinstance(value, torch.Tensor) and value.layout != torch.strided)


class Hybrid(Backend):
    name = "hybrid"

    def whole_graph(self, graph: WholeGraph) -> Lowering | str:
        why = inductor.available() or (
            "inference only (autoopt's kernels are inference lowerings, with no gradient)"
            if graph.gradients else
            "memory_budget's plan (recompute, offload) is applied to the aten graph"
            if graph.memory_plan else
            "no autoopt kernel in the graph: it would be the inductor backend"
            if not kernel_nodes(graph.gm) else "")
        if why:
            return why
        return Lowering(self.name, lambda: graph.warm(graph.call(lower(
            graph.gm, None if graph.adapt is not None else clone_inputs(graph.args, graph.kwargs),
            dynamic=graph.dynamic, settings=graph.settings("inductor")))),
            regions=lambda: regions(graph.gm), at_best=_AtBest(graph), **graph.packed)

    def subgraph(self, graph: Subgraph) -> str:
        # Its weights are inputs, not constants, so no weight is packed for autoopt's
        # kernels: hybrid would be the inductor backend.
        return "no autoopt kernel in a Dynamo subgraph (its weights are inputs)"


BACKEND = Hybrid()
