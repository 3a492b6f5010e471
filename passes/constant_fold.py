"""Compute once, at compile time, what depends on no input: parameter transposes, scalings and
casts, position ids built with ``arange`` and ``slice``.

    x ─ matmul(·, mul(t(w), 2)) ─ y      ⟶      x ─ matmul(·, w') ─ y      (w' = w.t() * 2, stored)
"""

from __future__ import annotations

import logging
import operator
from typing import Any

import torch
from torch.fx import GraphModule, Node
from torch.utils import _pytree as pytree

from . import ops
from .base import PassContext, PassResult
from .graph import add_constant, attr, storage_id

log = logging.getLogger(__name__)

_MAX_BYTES = 64 << 20  # never store a folded tensor larger than this
_MAX_GROWTH = 2  # nor one with more elements than this many times the tensors it is made from


def constant_fold(gm: GraphModule, ctx: PassContext) -> PassResult:
    """Evaluate pure, deterministic ATen ops whose inputs are all attributes or constants, and
    replace each such result that a non-constant node reads by a ``get_attr`` of a new buffer.

    Random ops, uninitialized memory (``empty``), ops that write to their arguments, and reads
    of attributes that the graph writes to are never folded. A result is not stored when it
    would be much larger than its inputs (``expand``, ``repeat``) or over ``max_bytes``.

    Args:
        gm: the graph module, rewritten in place. Existing attributes are never written.
        ctx: when ``training``, attributes that require grad are not folded (their gradients
            would be cut). ``options["max_bytes"]`` overrides the 64 MiB size limit.

    Example:
        >>> constant_fold(export_graph(model, (x,), {}), PassContext()).counts
        {'constant_folded': 2}
    """
    max_bytes = int(ctx.options.get("max_bytes", _MAX_BYTES))
    values, reads = _constants(gm, ctx, max_bytes)
    folded = [n for n in values if n.op == "call_function" and _replaceable(n, values)]
    chain = set().union(*(_ancestors(n, values) for n in folded))  # before any rewiring
    for node in folded:
        value = values[node].detach()
        # Copy a view of an attribute (t(w)): attributes are shared with the user's model. Copy
        # a view of a larger tensor (arange(n)[:k]) too, so the buffer holds only itself.
        if (storage_id(value) in reads[node]
                or value.untyped_storage().nbytes() != value.numel() * value.element_size()):
            value = value.clone()
        with gm.graph.inserting_before(node):
            new = add_constant(gm, "folded_constant", value)
        node.replace_all_uses_with(new)
    for node in reversed(list(gm.graph.nodes)):
        if node in chain and not node.users:  # pure by construction: plain dead-code removal
            gm.graph.erase_node(node)
    if folded:
        gm.recompile()
    return PassResult(gm, bool(folded), {"constant_folded": len(folded)} if folded else {})


def _constants(gm: GraphModule, ctx: PassContext, max_bytes: int,
               ) -> tuple[dict[Node, Any], dict[Node, set[int]]]:
    """Every node whose value depends on no input, with that value (in graph order), and the
    storages of the attributes each is computed from."""
    written = _written_storages(gm)
    values: dict[Node, Any] = {}
    sources: dict[Node, dict[int, int]] = {}  # constant -> {storage: numel} of attrs it reads
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            value = attr(gm, node.target)
            if not isinstance(value, torch.Tensor) or storage_id(value) in written:
                continue
            if ctx.training and value.requires_grad:
                continue
            values[node], sources[node] = value, {storage_id(value): value.numel()}
            continue
        if node.op != "call_function" or not _pure(node):
            continue
        inputs = node.all_input_nodes
        if not all(n in values for n in inputs) or _too_big(node.meta.get("val"), max_bytes):
            continue
        try:
            with torch.no_grad():
                args, kwargs = pytree.tree_map_only(Node, values.__getitem__,
                                                    (node.args, node.kwargs))
                value = node.target(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - an op that fails here is simply left alone
            log.debug("not folding %s: %s: %s", node, type(exc).__name__, exc)
            continue
        read = {k: v for n in inputs for k, v in sources[n].items()}
        if isinstance(value, torch.Tensor) and (_too_big(value, max_bytes) or (
                read and value.numel() > _MAX_GROWTH * sum(read.values()))):
            continue  # materializing it would cost memory the unfolded graph never holds
        values[node], sources[node] = value, read
    return values, {n: set(read) for n, read in sources.items()}


def _pure(node: Node) -> bool:
    """Whether ``node`` always computes the same value from the same arguments, writing
    nothing: an ATen op without mutation or randomness, or indexing into a tuple."""
    target = node.target
    if target is operator.getitem:
        return True
    # Custom ops may have effects (I/O, communication) their schema does not show.
    if not isinstance(target, torch._ops.OpOverload) or target.namespace not in ("aten", "prims"):
        return False
    schema = target._schema
    if schema.is_mutable or any(a.alias_info is not None and a.alias_info.is_write
                                for a in schema.arguments):
        return False
    if {torch.Tag.nondeterministic_seeded, torch.Tag.maybe_aliasing_or_mutating} & set(
            target.tags):
        return False  # random ops; composites (batch_norm) that may update their arguments
    return target.overloadpacket not in ops.UNINITIALIZED.aten


def _written_storages(gm: GraphModule) -> set[int]:
    """Storages of attributes the graph may write to (BatchNorm statistics, counters): their
    value changes from call to call, so nothing computed from them is constant."""
    written: set[int] = set()
    for node in gm.graph.nodes:
        if node.op != "get_attr":
            continue
        value = attr(gm, node.target)
        if isinstance(value, torch.Tensor) and any(_may_write(user) for user in node.users):
            written.add(storage_id(value))
    return written


def _may_write(user: Node) -> bool:
    """Whether ``user`` could write to its tensor arguments; unknown calls are assumed to."""
    if user.op == "output" or user.target is operator.getitem:
        return False
    if user.op == "call_function" and isinstance(user.target, torch._ops.OpOverload):
        schema = user.target._schema
        return (schema.is_mutable or torch.Tag.maybe_aliasing_or_mutating in user.target.tags
                or any(a.alias_info is not None and a.alias_info.is_write
                       for a in schema.arguments))
    return True


def _replaceable(node: Node, values: dict[Node, Any]) -> bool:
    """A folded tensor replaces ``node`` when some non-constant node reads it, nothing writes
    to it, and it is not returned (the caller would get the same stored tensor every call)."""
    if not isinstance(values[node], torch.Tensor):
        return False
    users = list(node.users)
    return (any(u not in values for u in users)
            and not any(u.op == "output" or _may_write(u) for u in users))


def _ancestors(node: Node, values: dict[Node, Any]) -> set[Node]:
    """``node`` and the constant nodes it is computed from."""
    seen: set[Node] = set()
    stack = [node]
    while stack:
        n = stack.pop()
        if n in seen or n not in values:
            continue
        seen.add(n)
        stack.extend(n.all_input_nodes)
    return seen


def _too_big(value: Any, max_bytes: int) -> bool:
    """Whether a tensor (or its fake metadata) is over the byte limit; unknown is not."""
    if not isinstance(value, torch.Tensor) or not all(isinstance(d, int) for d in value.shape):
        return False
    return value.numel() * value.element_size() > max_bytes
