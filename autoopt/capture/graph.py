"""Turn an ``nn.Module`` and example inputs into an FX ``GraphModule`` whose every value node
carries ``meta["val"]`` (a fake tensor with shape, dtype, device and strides).

Two whole-graph methods, tried in this order by ``autoopt.compile.specialize``:

- ``export``: ``torch.export`` in non-strict mode, ATen-level graph, parameters as attributes,
  input guards kept. Dynamic dimensions come from ``dynamic_shapes`` or ``dynamic=True``.
- ``symbolic_trace``: ``torch.fx.symbolic_trace`` at module/functional level, non-tensor
  arguments fixed to their example values, metadata from one real run.

Partial capture (Dynamo, the rest eager) lives in ``autoopt.compile.dynamo``.
"""

from __future__ import annotations

import contextlib
import inspect
import io
import logging
import warnings
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch import nn
from torch._guards import detect_fake_mode
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.fx import GraphModule, Interpreter, Node
from torch.utils import _pytree as pytree

from autoopt.capture import objects
from autoopt.check.state import preserved

log = logging.getLogger(__name__)


def export_graph(module: nn.Module, args: tuple[Any, ...], kwargs: Mapping[str, Any],
                 dynamic: bool = False, dynamic_shapes: Any = None,
                 output_types: tuple[type, ...] = ()) -> GraphModule:
    """Capture with ``torch.export`` (non-strict) and return the unlifted graph module.

    Args:
        module: the module to capture; its parameters are shared, not copied.
        args, kwargs: example inputs.
        dynamic: mark every dimension of every tensor input ``Dim.AUTO`` (export keeps
            dynamic what the model allows and specializes the rest).
        dynamic_shapes: passed to ``torch.export.export`` as is; wins over ``dynamic``.
        output_types: classes in the model's output that torch's pytree does not know
            (``objects.foreign_types`` of an eager output: a ``DynamicCache``); taken apart
            while exporting and rebuilt by the graph module (see ``objects``).
    """
    if dynamic_shapes is None and dynamic:
        dynamic_shapes = _auto_dynamic_shapes(module, args, kwargs)
    with _quiet_export(), _attributes_restored(module), \
            objects.as_pytree_nodes(output_types) as scoped:
        program = torch.export.export(module, tuple(args), dict(kwargs), strict=False,
                                      dynamic_shapes=dynamic_shapes)
        gm = objects.make_portable(_without_runtime_checks(program.module()), scoped)
    # The sizes export proved the graph for (the signature guards them instead of _guards_fn).
    gm.meta["range_constraints"] = dict(program.range_constraints)
    return gm


def _without_runtime_checks(unlifted: GraphModule) -> GraphModule:
    """A plain GraphModule of the exported graph, without export's per-call input checks (its
    ``_guards_fn`` node and pre-hooks): autoopt's own input signature guards every call, and
    the checks cost more than a small model's whole forward (~100 µs a call)."""
    graph = unlifted.graph
    for node in list(graph.nodes):
        if node.op == "call_module" and node.target == "_guards_fn" and not node.users:
            graph.erase_node(node)
    plain = GraphModule(unlifted, graph, class_name="ExportedGraph")
    plain.meta = dict(getattr(unlifted, "meta", {}))
    return plain


@contextlib.contextmanager
def _quiet_export() -> Iterator[None]:
    """A failed export prints its partial graph to stderr and logs warnings; autoopt reports
    the failure itself (and falls back), so keep that at debug level."""
    noisy = logging.getLogger("torch.fx.experimental.symbolic_shapes")
    level = noisy.level
    noisy.setLevel(logging.ERROR)
    captured = io.StringIO()
    try:
        with contextlib.redirect_stderr(captured):
            yield
    finally:
        noisy.setLevel(level)
        if captured.getvalue():
            log.debug("torch.export printed:\n%s", captured.getvalue())


def _auto_dynamic_shapes(module: nn.Module, args: tuple[Any, ...],
                         kwargs: Mapping[str, Any]) -> Any:
    auto = torch.export.Dim.AUTO
    return dynamic_shapes_for(module.forward, args, kwargs,
                              lambda t: {d: auto for d in range(t.dim())} or None)


def dynamic_shapes_for(forward: Callable[..., Any], args: tuple[Any, ...],
                       kwargs: Mapping[str, Any],
                       tensor_dims: Callable[[torch.Tensor], dict[int, Any] | None]) -> Any:
    """A ``torch.export`` ``dynamic_shapes`` keyed by ``forward``'s argument names, with
    ``tensor_dims(t)`` giving each tensor input's dynamic dimensions (None: all static),
    walking into lists, tuples and dicts."""
    def spec(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return tensor_dims(value)
        if isinstance(value, (list, tuple)):
            return type(value)(spec(v) for v in value)
        if isinstance(value, dict):
            return {k: spec(v) for k, v in value.items()}
        return None

    signature = inspect.signature(forward)
    bound = signature.bind(*args, **kwargs)
    shapes: dict[str, Any] = {}
    for name, value in bound.arguments.items():
        kind = signature.parameters[name].kind
        if kind is inspect.Parameter.VAR_POSITIONAL:
            shapes[name] = tuple(spec(v) for v in value)
        elif kind is inspect.Parameter.VAR_KEYWORD:
            shapes[name] = {k: spec(v) for k, v in value.items()}
        else:
            shapes[name] = spec(value)
    return shapes


def symbolic_trace_graph(module: nn.Module, args: tuple[Any, ...], kwargs: Mapping[str, Any],
                         ) -> tuple[GraphModule, Callable[..., tuple[Any, ...]]]:
    """Capture with ``torch.fx.symbolic_trace``; non-tensor arguments become constants.

    Returns the graph module and ``positional(*args, **kwargs)``, which maps a call in the
    original forward's convention onto the graph's placeholders (every parameter, in order).
    The graph asserts its constants itself; the caller's input signature guards them too.
    """
    signature = inspect.signature(module.forward)
    for name, param in signature.parameters.items():
        if param.kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD):
            raise TypeError(f"symbolic_trace cannot trace *{name}; export or Dynamo can")

    def positional(*call_args: Any, **call_kwargs: Any) -> tuple[Any, ...]:
        bound = signature.bind(*call_args, **call_kwargs)
        bound.apply_defaults()
        return tuple(bound.arguments.values())

    bound = signature.bind(*args, **kwargs)
    bound.apply_defaults()
    concrete = {name: value for name, value in bound.arguments.items()
                if not isinstance(value, torch.Tensor)}
    gm = _trace(module, concrete or None)
    annotate(gm, list(positional(*args, **kwargs)))
    return gm, positional


class _BufferTracer(torch.fx.Tracer):
    """``symbolic_trace``'s tracer, but a buffer read in ``forward`` is a graph node too.

    By default FX hands ``forward`` the real buffer, so ``self.count.add_(1)`` runs once on the
    live tensor while tracing and is missing from the graph, which then never counts.
    """

    proxy_buffer_attributes = True


def _trace(module: nn.Module, concrete: dict[str, Any] | None) -> GraphModule:
    # A failed attempt is recorded by the caller; FX's warnings about it are noise here.
    with _attributes_restored(module), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return _trace_module(module, concrete)


@contextlib.contextmanager
def _attributes_restored(module: nn.Module) -> Iterator[None]:
    """Put every submodule's attributes back as they were: FX's tracer stores the constants
    it meets on the root (``_tensor_constant0``), and a forward that caches on its first call
    (torchvision's anchor generator, RoI pooling scales) caches proxies while tracing. Left in
    place, they break the next capture method (Dynamo) or a later eager call."""
    saved = [(m, dict(vars(m))) for m in module.modules()]
    try:
        yield
    finally:
        for m, attributes in saved:
            state = vars(m)
            for key in [k for k in state if k not in attributes]:
                del state[key]
            for key, value in attributes.items():
                if state.get(key, _MISSING) is not value:
                    state[key] = value


_MISSING = object()


def _trace_module(module: nn.Module, concrete: dict[str, Any] | None) -> GraphModule:
    try:
        tracer: torch.fx.Tracer = _BufferTracer()
        graph = tracer.trace(module, concrete_args=concrete)
    except Exception:  # noqa: BLE001 - retried below with real buffers
        # A buffer's value steering Python (``range(self.table.size(0))``) needs the real
        # buffer, which is then fine as long as tracing writes none of them.
        before = {name: b._version for name, b in module.named_buffers()}
        with preserved(module):
            tracer = torch.fx.Tracer()
            graph = tracer.trace(module, concrete_args=concrete)
            written = [name for name, b in module.named_buffers()
                       if b._version != before.get(name)]
        if written:
            raise TypeError(f"forward writes buffer {written[0]} in a way symbolic_trace "
                            f"cannot record; export or Dynamo can") from None
    return GraphModule(tracer.root, graph, module.__class__.__name__)


def annotate(gm: GraphModule, example_inputs: list[Any]) -> GraphModule:
    """Give every node without ``meta["val"]`` one: Dynamo's ``example_value`` where present,
    else by propagating fake tensors through the graph.

    The graph never runs on the caller's tensors: its in-place writes (``x[:, 0] = 1``,
    ``x.mul_(2)``, BatchNorm statistics) would happen once more than the user asked for. Only
    a graph fake tensors cannot follow (``.item()`` deciding a shape) runs for real, on
    copies of the inputs with the module's buffers put back.
    """
    nodes = [n for n in gm.graph.nodes if n.op != "output"]
    for n in nodes:
        if "val" not in n.meta and "example_value" in n.meta:
            n.meta["val"] = n.meta["example_value"]
    if all("val" in n.meta for n in nodes):
        return gm
    try:
        # Dynamo's own fake mode (its shape environment holds the graph's symbols), else one
        # with static shapes.
        mode = detect_fake_mode([n.meta.get("val") for n in nodes]) or FakeTensorMode()
        _FakeRecorder(gm, mode).run(*example_inputs)
    except Exception as exc:  # noqa: BLE001 - any op fake tensors cannot run
        log.debug("fake propagation failed (%s: %s); recording from a run on copies",
                  type(exc).__name__, exc)
        private = [x.detach().clone().requires_grad_(x.requires_grad)
                   if isinstance(x, torch.Tensor) else x for x in concrete_inputs(example_inputs)]
        with preserved(gm):
            _MetaRecorder(gm).run(*private)
    return gm


def concrete_inputs(values: list[Any]) -> list[Any]:
    """``values`` with each symbolic number (Dynamo passes a dynamic size as a ``SymInt``
    input) replaced by the value it has in this call, so the graph can run on real tensors."""
    def concrete(value: Any) -> Any:
        if not isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            return value
        hint = value.node.hint
        if hint is None:
            raise ValueError(f"symbolic input {value} has no concrete value to run with")
        return hint

    return [concrete(v) for v in values]


class _FakeRecorder(Interpreter):
    """Runs the graph on fake tensors and stores each missing result in ``meta["val"]``.

    Nodes that already have a value keep it (Dynamo computed it while tracing); weights and
    module state reach the graph as fakes, so nothing real is read or written.
    """

    def __init__(self, gm: GraphModule, mode: FakeTensorMode) -> None:
        super().__init__(gm)
        self._mode = mode

    def run(self, *args: Any, **kwargs: Any) -> Any:
        with self._mode:
            return super().run(*args, **kwargs)

    def run_node(self, n: Node) -> Any:
        if n.op == "output":
            return super().run_node(n)
        if "val" in n.meta:
            if n.op == "placeholder":
                next(self.args_iter)  # keep the later placeholders on their own inputs
            return n.meta["val"]
        result = super().run_node(n)
        n.meta["val"] = result
        return result

    def placeholder(self, target: Any, args: Any, kwargs: Any) -> Any:
        return self._fake(super().placeholder(target, args, kwargs))

    def get_attr(self, target: Any, args: Any, kwargs: Any) -> Any:
        return self._fake(super().get_attr(target, args, kwargs))

    def call_module(self, target: Any, args: Any, kwargs: Any) -> Any:
        module = self.fetch_attr(target)
        state = {name: self._fake(t) for name, t in
                 [*module.named_parameters(remove_duplicate=False),
                  *module.named_buffers(remove_duplicate=False)]}
        return torch.func.functional_call(module, state, tuple(args), dict(kwargs))

    def _fake(self, value: Any) -> Any:
        if not isinstance(value, torch.Tensor) or isinstance(value, FakeTensor):
            return value
        return self._mode.from_tensor(value, static_shapes=True)


class _MetaRecorder(Interpreter):
    """Runs the graph for real and stores a fake copy of each missing result in
    ``meta["val"]``."""

    def __init__(self, gm: GraphModule) -> None:
        super().__init__(gm)
        self._fake_mode = FakeTensorMode(allow_non_fake_inputs=True)

    def run_node(self, n: Node) -> Any:
        result = super().run_node(n)
        if n.op != "output" and "val" not in n.meta:
            n.meta["val"] = pytree.tree_map_only(torch.Tensor, self._to_fake, result)
        return result

    def _to_fake(self, t: torch.Tensor) -> torch.Tensor:
        return self._fake_mode.from_tensor(t, static_shapes=True)


def flat_example_inputs(gm: GraphModule, args: tuple[Any, ...],
                        kwargs: Mapping[str, Any]) -> tuple[Any, ...]:
    """One example value per placeholder, for ``PassContext.example_inputs``."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    leaves = pytree.tree_leaves((tuple(args), dict(kwargs)))
    if len(leaves) == len(placeholders):
        return tuple(leaves)
    tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
    return tuple(tensors) if len(tensors) == len(placeholders) else ()
