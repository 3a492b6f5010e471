"""Small graph helpers every pass needs: matching calls at any capture level, arguments by name,
node metadata, attributes, new constants; and what the compiler reads of a graph module the
passes made: a cheap copy (``copy_graph_module``), the graph to export (``portable``), the graph
before precision casting (``full_precision``). One place, so passes read alike and a fix lands
everywhere."""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.fx import GraphModule, Node, _lazy_graph_module
from torch.fx.experimental.symbolic_shapes import is_concrete_int
from torch.fx.operator_schemas import normalize_function

from autoopt.cost_model.isolation import is_read_only, mark_read_only

from . import ops


def is_call(node: Any, op_set: ops.OpSet) -> bool:
    """Whether ``node`` calls an op of ``op_set``, at whichever level its graph is written: a
    function or ATen overload (``call_function``), a Tensor method (``call_method``) or a module
    (``call_module``) of exactly one of the set's classes, since a subclass may override
    ``forward``.

    Example:
        >>> is_call(node, ops.SOFTMAX)  # aten.softmax.int, torch.softmax, F.softmax, x.softmax
    """
    if not isinstance(node, Node):
        return False
    if node.op == "call_function":
        return node.target in op_set.functions
    if node.op == "call_method":
        return node.target in op_set.methods
    if node.op == "call_module" and op_set.modules:
        return type(attr(node.graph.owning_module, node.target)) in op_set.modules
    return False


def match_path(node: Any, path: Sequence[ops.OpSet]) -> list[Node] | None:
    """``[node, its first argument, that one's first argument, ...]`` when each calls an op of
    the set at its place in ``path``; None where one does not (or has no positional argument).

    Example:
        >>> match_path(out, [ops.MATMUL, ops.SOFTMAX])  # softmax(s) @ v → [out, softmax]
    """
    matched: list[Node] = []
    for op_set in path:
        if not is_call(node, op_set):
            return None
        matched.append(node)
        node = node.args[0] if node.args else None
    return matched


def call_kwargs(node: Node) -> dict[str, Any] | None:
    """The call's arguments by parameter name (``self`` is named ``input``); None when the
    target's signature cannot be matched.

    A Tensor method is read as the ``torch`` function of its name, which takes ``self`` as its
    first argument (``x.softmax(-1)`` is ``torch.softmax(x, -1)``); where the two signatures
    differ (``x.permute(0, 2, 1)``) the arguments do not match it and the answer is None.
    """
    target = node.target
    if node.op == "call_method":
        target = getattr(torch, str(target), None)
        if target is None:
            return None
    try:
        pair = normalize_function(target, node.args, node.kwargs,
                                  normalize_to_only_use_kwargs=True)
    except Exception:  # noqa: BLE001 - an unmatchable signature simply means "no match"
        return None
    return dict(pair.kwargs) if pair is not None else None


def meta_val(node: Any) -> Any:
    """The node's example value (``meta["val"]``, or Dynamo's ``example_value``)."""
    if not isinstance(node, Node):
        return None
    return node.meta.get("val", node.meta.get("example_value"))


def size_hints(value: Any) -> tuple[int, ...] | None:
    """A tensor's sizes as ints, each symbolic one (a graph captured with ``dynamic=``) as the
    value it was traced with: the shape a measurement runs at. None where a size has no such
    value, or ``value`` is not a tensor."""
    if not isinstance(value, torch.Tensor):
        return None
    sizes = []
    for s in value.shape:
        hint = s if isinstance(s, int) else getattr(getattr(s, "node", None), "hint", None)
        if not isinstance(hint, int):
            return None
        sizes.append(hint)
    return tuple(sizes)


def has_symbolic_size(value: torch.Tensor) -> bool:
    """Whether a size of ``value`` is symbolic (a graph captured with ``dynamic=``). Read
    without comparing sizes: ``==`` on a symbolic size adds a guard to the graph."""
    return not all(map(is_concrete_int, value.shape))


def attr(gm: GraphModule, target: Any) -> Any:
    """The object a ``get_attr`` target (or node) names on ``gm``; None if absent."""
    if isinstance(target, Node):
        target = target.target
    value: Any = gm
    for atom in str(target).split("."):
        value = getattr(value, atom, None)
    return value


def constant_tensor(gm: GraphModule, node: Any) -> torch.Tensor | None:
    """The tensor a ``get_attr`` node names on ``gm`` (a weight, a buffer, a folded constant);
    None for anything else: an input, a computed value, a non-tensor attribute."""
    if not (isinstance(node, Node) and node.op == "get_attr"):
        return None
    value = attr(gm, node)
    return value if isinstance(value, torch.Tensor) else None


def storage_id(t: torch.Tensor) -> int:
    """Identifies the memory a tensor lives in (shared by its views and tied weights)."""
    return t.untyped_storage().data_ptr()


def fresh_name(gm: GraphModule, base: str) -> str:
    i = 0
    while hasattr(gm, f"{base}_{i}"):
        i += 1
    return f"{base}_{i}"


def add_constant(gm: GraphModule, base: str, value: torch.Tensor) -> Node:
    """Register ``value`` as a new buffer of ``gm`` under a fresh name and return a
    ``get_attr`` node for it (inserted at the current insertion point)."""
    name = fresh_name(gm, base)
    # The graph only reads it: runs need not copy it to put it back (``preserved``).
    gm.register_buffer(name, mark_read_only(value))
    node = gm.graph.get_attr(name)
    node.meta["val"] = fake_like(gm, value)
    return node


def fake_like(gm: GraphModule, value: torch.Tensor) -> torch.Tensor:
    """A fake copy of ``value`` in the graph's own fake mode, so metadata stays one family
    (and deep copies of the graph do not copy real data)."""
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    mode = next((n.meta["val"].fake_mode for n in gm.graph.nodes
                 if isinstance(n.meta.get("val"), FakeTensor)), None) or FakeTensorMode()
    return mode.from_tensor(value, static_shapes=True)


def is_impure(node: Node) -> bool:
    """Whether running ``node`` does more than compute its result, so that it must run even when
    nobody reads the result: it writes a tensor in place, draws random numbers, changes grad
    mode, or is a placeholder, output or guard.

    FX answers this for ATen overloads from their schemas, but calls every torch-level
    ``call_method`` pure and knows nothing of ``out=``, ``inplace=True`` or the statistics a
    training BatchNorm updates; Dynamo graphs are written with exactly those
    (``self.count.add_(1)``, ``num_batches_tracked.add_(1)``, ``x[:, 0] = 1``).

    Example:
        >>> gm.graph.eliminate_dead_code(is_impure_node=is_impure)
    """
    if node.op in ("placeholder", "output"):
        return True
    if node.op == "call_module":
        return _module_is_impure(attr(node.graph.owning_module, node.target))
    if node.kwargs.get("out") is not None:
        return True
    if node.op == "call_method":
        return _inplace_name(str(node.target)) or node.target in ops.INPLACE_OPERATORS.methods
    if node.op != "call_function":
        return False
    target = node.target
    if target in ops.INPLACE_OPERATORS.functions or node.is_impure():
        return True
    if target in ops.STATISTICS_UPDATING.functions:
        return _updates_statistics(call_kwargs(node))
    if isinstance(target, torch._ops.OpOverload):
        return False  # its schema, which FX read, says whether it writes
    if _inplace_name(getattr(target, "__name__", "")) or node.kwargs.get("inplace"):
        return True
    kwargs = call_kwargs(node)  # `F.relu(x, True)`: inplace given by position
    return bool(kwargs and kwargs.get("inplace"))


def written_placeholders(gm: GraphModule) -> set[int]:
    """The positions of ``gm``'s inputs that running it may write in place (see
    ``written_roots``)."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    roots = written_roots(gm)
    return {i for i, n in enumerate(placeholders) if n in roots}


def written_attributes(gm: GraphModule) -> list[str]:
    """The module attributes (buffers, parameters, an optimizer's state that Dynamo reads
    as attributes) ``gm`` may write in place, by target (see ``written_roots``)."""
    roots = written_roots(gm)
    return list(dict.fromkeys(str(n.target) for n in gm.graph.nodes
                              if n.op == "get_attr" and n in roots))


def written_tensors(gm: GraphModule) -> list[torch.Tensor]:
    """The module tensors ``gm`` may write in place through ``get_attr`` (see
    ``written_attributes``), for a run to put back."""
    found = (attr(gm, name) for name in written_attributes(gm))
    return [t for t in found if isinstance(t, torch.Tensor)]


def written_roots(gm: GraphModule) -> set[Node]:
    """The placeholders and ``get_attr`` nodes whose tensors running ``gm`` may write in
    place: those an impure call (see ``is_impure``) takes as its first argument (each of them
    for a list: ``_foreach_add_``'s parameters), directly or through views of them (``view``,
    ``__getitem__``, ``transpose``, ...) and results of in-place calls on them (``b.mul_(m)
    .add_(g)``). An input that only feeds what is written (a weight before an in-place ReLU)
    is not written."""
    found: set[Node] = set()
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output") or not node.args or not is_impure(node):
            continue
        first = node.args[0]
        roots = list(first) if isinstance(first, (list, tuple)) else [first]
        seen: set[Node] = set()
        while roots:
            root = roots.pop()
            if not isinstance(root, Node) or root in seen:
                continue
            seen.add(root)
            if root.op in ("placeholder", "get_attr"):
                found.add(root)
            elif (_is_view(root) or is_impure(root)) and root.args:
                base = root.args[0]
                roots.extend(base if isinstance(base, (list, tuple)) else [base])
    return found


# Calls whose result shares its first argument's memory (by name, at every capture level).
_VIEWS = frozenset({
    "view", "view_as", "_unsafe_view", "reshape", "reshape_as", "transpose", "permute", "t",
    "unsqueeze", "squeeze", "expand", "expand_as", "flatten", "unflatten", "narrow", "select",
    "slice", "__getitem__", "getitem", "detach", "alias", "as_strided", "split", "chunk",
    "unbind", "movedim", "swapaxes", "swapdims", "diagonal", "unfold", "real", "imag",
    "view_as_real", "view_as_complex", "contiguous", "split_with_sizes", "tensor_split"})


def _is_view(node: Node) -> bool:
    if node.op == "call_method":
        return str(node.target) in _VIEWS
    if node.op != "call_function":
        return False
    name = getattr(node.target, "__name__", "")
    return name.split(".")[0] in _VIEWS


def _updates_statistics(kwargs: dict[str, Any] | None) -> bool:
    if kwargs is None:
        return True  # unreadable arguments: assume the write
    batch_statistics = kwargs.get("training", kwargs.get("use_input_stats", True))
    return batch_statistics is not False and kwargs.get("running_mean") is not None


def _inplace_name(name: str) -> bool:
    """PyTorch's convention: ``add_``, ``relu_``, ``copy_`` write to their first argument."""
    return name.endswith("_") and not name.endswith("__")


def _module_is_impure(module: Any) -> bool:
    if isinstance(module, GraphModule):
        return any(n.op not in ("placeholder", "output") and is_impure(n)
                   for n in module.graph.nodes)
    if not isinstance(module, nn.Module) or getattr(module, "_is_impure", False):
        return True
    if not type(module).__module__.startswith("torch.nn."):
        return True  # a user's leaf module: its forward is not visible to check
    if any(getattr(m, "inplace", False) for m in module.modules()):
        return True
    # BatchNorm and InstanceNorm update running statistics, but only in training.
    return module.training and next(module.buffers(), None) is not None


def release_packed(gm: GraphModule) -> int:
    """Drop the packed weight copies of ``gm``'s kernels (``packed_linear``, ``onednn_conv``)
    that they can make again: the bytes dropped. While another backend is built and measured,
    its own copies then need not fit next to these. Each kernel packs again on its next call,
    or at ``restore_packed``."""
    return sum(kernel.release() for kernel in _packed_kernels(gm))


def restore_packed(gm: GraphModule) -> None:
    """Pack again what ``release_packed`` dropped (the same weights, the same layout)."""
    for kernel in _packed_kernels(gm):
        kernel.restore()


def _packed_kernels(gm: GraphModule) -> list[Any]:
    return list({id(node.target): node.target for node in gm.graph.nodes
                 if node.op == "call_function" and callable(getattr(node.target, "release", None))
                 and callable(getattr(node.target, "restore", None))}.values())


def copy_graph_module(gm: GraphModule, lazy: bool = False) -> GraphModule:
    """A module with its own graph (so a pass can rewrite it) sharing gm's tensors and
    submodules (so the copy costs no parameter memory).

    ``lazy``: its Python code is generated at its first call or ``realized``, not now nor at
    each ``recompile``. The pass runner's copies are: a pass that changes nothing leaves its
    copy unused, and a pass's own ``recompile`` is followed by the next pass's copy, so only
    the graph the pipeline returns is compiled (on the 8-layer Llama-style decoder's three int8
    graphs, 64 code generations where there were 123: 3.3 s of setup, now 1.3)."""
    graph = copy.deepcopy(gm.graph)
    cls = _lazy_graph_module._LazyGraphModule if lazy else GraphModule
    new = cls(gm, graph, class_name=type(gm).__name__)
    new.meta = dict(getattr(gm, "meta", {}))
    return new


def realized(gm: GraphModule) -> GraphModule:
    """``gm`` with its Python code generated (a lazy copy's, see ``copy_graph_module``), so
    what reads its ``code`` or its forward's signature (exporters, Dynamo) sees the graph's;
    returns ``gm``."""
    _lazy_graph_module._LazyGraphModule.force_recompile(gm)
    return gm


def drop_unread_constants(gm: GraphModule) -> None:
    """Take out of ``gm`` the constants passes made (read-only) that no node reads any more:
    a merged weight a lowering packed is held by the packed kernel's copy alone."""
    for node in [n for n in gm.graph.nodes if n.op == "get_attr" and not n.users]:
        value = attr(gm, node)
        if isinstance(value, torch.Tensor) and is_read_only(value):
            gm.graph.erase_node(node)
    read = {str(n.target) for n in gm.graph.nodes if n.op == "get_attr"}
    for name, value in list(gm.named_buffers(recurse=False)):
        if name not in read and is_read_only(value):
            delattr(gm, name)
    gm.recompile()


# ``gm.meta[FULL_PRECISION]``: the graph before the ``precision`` pass cast it, where it did.
FULL_PRECISION = "full_precision"


def full_precision(gm: GraphModule) -> GraphModule | None:
    """The graph ``gm`` was before ``precision=`` cast it (portable, as ``portable``'s), or
    None where the precision pass did not change it."""
    return gm.meta.get(FULL_PRECISION)


def portable(gm: GraphModule) -> GraphModule:
    """The graph to export for ``gm``: the last one before device-specific lowering passes
    (``autoopt.passes.LOWERING``), which a file for another runtime cannot hold."""
    return gm.meta.get("portable", gm)


def graph_to_keep(gm: GraphModule, backend: str) -> GraphModule:
    """The graph an optimized module keeps for a specialization (export, inspection): ``gm``
    where it runs the calls (``backend`` empty: aten), else the graph the other backend was
    lowered from (``portable``), without the aten lowerings' packed weight copies that no
    call would read (``hybrid`` calls them: it keeps ``gm``)."""
    return gm if backend in ("", "hybrid") else portable(gm)
