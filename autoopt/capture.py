"""Turn an ``nn.Module`` and example inputs into an FX ``GraphModule`` whose every value node
carries ``meta["val"]`` (a fake tensor with shape, dtype, device and strides).

Two whole-graph methods, tried in this order by ``autoopt.api``:

- ``export``: ``torch.export`` in non-strict mode, ATen-level graph, parameters as attributes,
  input guards kept. Dynamic dimensions come from ``dynamic_shapes`` or ``dynamic=True``.
- ``symbolic_trace``: ``torch.fx.symbolic_trace`` at module/functional level, non-tensor
  arguments fixed to their example values, metadata from one real run.

Partial capture (Dynamo, the rest eager) lives in ``autoopt.backend``.
"""

from __future__ import annotations

import contextlib
import inspect
import io
import logging
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx import GraphModule, Interpreter, Node
from torch.utils import _pytree as pytree

log = logging.getLogger(__name__)


def export_graph(module: nn.Module, args: tuple[Any, ...], kwargs: Mapping[str, Any],
                 dynamic: bool = False, dynamic_shapes: Any = None) -> GraphModule:
    """Capture with ``torch.export`` (non-strict) and return the unlifted graph module.

    Args:
        module: the module to capture; its parameters are shared, not copied.
        args, kwargs: example inputs.
        dynamic: mark every dimension of every tensor input ``Dim.AUTO`` (export keeps
            dynamic what the model allows and specializes the rest).
        dynamic_shapes: passed to ``torch.export.export`` as is; wins over ``dynamic``.
    """
    if dynamic_shapes is None and dynamic:
        dynamic_shapes = _auto_dynamic_shapes(module, args, kwargs)
    with _quiet_export():
        program = torch.export.export(module, tuple(args), dict(kwargs), strict=False,
                                      dynamic_shapes=dynamic_shapes)
    return _without_runtime_checks(program.module())


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
    gm = torch.fx.symbolic_trace(module, concrete_args=concrete or None)
    annotate(gm, list(positional(*args, **kwargs)))
    return gm, positional


def annotate(gm: GraphModule, example_inputs: list[Any]) -> GraphModule:
    """Give every node without ``meta["val"]`` one, by running the graph once on real inputs
    (``example_value`` from Dynamo is reused where present)."""
    if all(_has_val(n) for n in gm.graph.nodes if n.op != "output"):
        return gm
    missing = [n for n in gm.graph.nodes if n.op != "output" and not _has_val(n)]
    if all("example_value" in n.meta for n in missing):
        for n in missing:
            n.meta["val"] = n.meta["example_value"]
        return gm
    _MetaRecorder(gm).run(*example_inputs)
    return gm


def _has_val(node: Node) -> bool:
    return "val" in node.meta


class _MetaRecorder(Interpreter):
    """Runs the graph for real and stores a fake copy of each result in ``meta["val"]``."""

    def __init__(self, gm: GraphModule) -> None:
        super().__init__(gm)
        self._fake_mode = FakeTensorMode(allow_non_fake_inputs=True)

    def run_node(self, n: Node) -> Any:
        result = super().run_node(n)
        if n.op != "output":
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
