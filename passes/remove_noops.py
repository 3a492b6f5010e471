"""Remove ops that compute nothing: eval-mode dropout, identity modules, x*1, x+0, and views or
casts that leave their input as it was.

    x ─ dropout(train=False) ─ mul(·, 1) ─ view(same shape) ─ y      ⟶      x ─ y
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
from torch.fx import GraphModule, Node

from . import ops
from .base import PassContext, PassResult
from .graph import call_kwargs, meta_val

# In-place Python operators Dynamo graphs use for `x += y`.
_INPLACE_OPERATORS = frozenset({"iadd", "isub", "imul", "itruediv", "ifloordiv", "imod", "ipow",
                                "iand", "ior", "ixor", "ilshift", "irshift"})


def remove_noops(gm: GraphModule, ctx: PassContext) -> PassResult:
    """Replace each no-op node by its input.

    An op that returns a *new* tensor (``x * 1``, ``x + 0``) is only removed when nothing writes to
    its result in place and it is not returned from the graph, since then sharing storage with
    its input would be visible. Ops that already return their input or an alias of it (eval
    dropout, ``view`` to the same shape, ``to`` the same dtype) are removed whenever the input
    passes through unchanged.

    Args:
        gm: the graph module, rewritten in place.
        ctx: unused beyond the interface; no-op detection reads only node metadata.
    """
    counts: Counter[str] = Counter()
    for node in list(gm.graph.nodes):
        found = _noop_input(gm, node)
        if found is None:
            continue
        source, kind, makes_new_tensor = found
        if makes_new_tensor and not _result_is_private(node):
            continue
        node.replace_all_uses_with(source)
        gm.graph.erase_node(node)
        counts[kind] += 1
    if counts:
        gm.recompile()
    return PassResult(gm, bool(counts), dict(counts))


def _noop_input(gm: GraphModule, node: Node) -> tuple[Node, str, bool] | None:
    """Return (input node, kind, whether the op makes a new tensor) when ``node`` is a no-op."""
    if node.op == "call_module":
        module = gm.get_submodule(str(node.target))
        if not node.args or not isinstance(node.args[0], Node) or node.kwargs:
            return None
        if isinstance(module, ops.IDENTITY_MODULES):
            return node.args[0], "identity", False
        if isinstance(module, ops.DROPOUT_MODULES) and (not module.training or module.p == 0):
            return node.args[0], "dropout", False
        return None
    if node.op != "call_function":
        return None
    target = node.target
    if target in ops.DROPOUT_FUNCTIONS:
        kw = (call_kwargs(node) or {})
        x = kw.get("input")
        training = kw.get("train", kw.get("training", True))
        # Eager dropout returns its input itself when not training, so this is an alias.
        if isinstance(x, Node) and (training is False or kw.get("p") == 0) and _same_tensor_type(
                node, x):
            return x, "dropout", False
        return None
    if target in ops.BINARY_ARITHMETIC:
        return _arithmetic_identity(node)
    if target in ops.TO_SAME:
        kw = (call_kwargs(node) or {})
        x = kw.get("input", kw.get("self"))
        if (isinstance(x, Node) and not kw.get("copy", False)
                and kw.get("memory_format") in (None, torch.preserve_format)
                and _same_tensor_type(node, x, strides=True)):
            return x, "alias", False
        return None
    if target in ops.CONTIGUOUS:
        x = node.args[0] if node.args else None
        val = meta_val(x) if isinstance(x, Node) else None
        fmt = (call_kwargs(node) or {}).get("memory_format", torch.contiguous_format)
        if (isinstance(val, torch.Tensor) and isinstance(fmt, torch.memory_format)
                and _static(val.shape) and val.is_contiguous(memory_format=fmt)):
            return x, "alias", False
        return None
    if target in ops.RESHAPE or target in ops.EXPAND:
        x = node.args[0] if node.args else None
        if isinstance(x, Node) and _same_tensor_type(node, x, strides=True):
            return x, "alias", False
        return None
    if target in ops.PERMUTE:
        x, dims = node.args[0], node.args[1]
        val = meta_val(x) if isinstance(x, Node) else None
        if isinstance(val, torch.Tensor) and [d % max(val.dim(), 1) for d in dims] == list(
                range(val.dim())):
            return x, "alias", False
        return None
    if target in ops.SLICE:
        return _full_slice(node)
    if target in ops.ASSERT_METADATA:
        return _proven_assert(node)
    return None


def _proven_assert(node: Node) -> tuple[Node, str, bool] | None:
    """An ``_assert_tensor_metadata`` that the input's metadata already proves. It has no
    result, so it is "replaced" by its input and erased."""
    kw = (call_kwargs(node) or {})
    x = kw.get("input", kw.get("a", node.args[0] if node.args else None))
    val = meta_val(x) if isinstance(x, Node) else None
    if not isinstance(val, torch.Tensor) or node.users:
        return None
    expected = {"dtype": val.dtype, "device": val.device, "layout": val.layout}
    if all(kw.get(k) in (None, v) for k, v in expected.items()):
        return x, "assert", False
    return None


def _arithmetic_identity(node: Node) -> tuple[Node, str, bool] | None:
    target = node.target
    if len(node.args) != 2:
        return None
    a, b = node.args
    commutative = target in ops.MULTIPLY or target in ops.ADD
    neutral = 1 if (target in ops.MULTIPLY or target in ops.DIVIDE) else 0
    if _is_number(b, neutral) and isinstance(a, Node):
        source = a
    elif commutative and _is_number(a, neutral) and isinstance(b, Node):
        source = b
    else:
        return None
    alpha = node.kwargs.get("alpha", 1)
    if neutral == 0 and not _is_number(alpha, 1) and alpha is not None:
        # x + 0 * alpha is still x, but keep the rule to the plain form.
        return None
    if not _same_tensor_type(node, source):
        return None
    return source, "arithmetic", True


def _full_slice(node: Node) -> tuple[Node, str, bool] | None:
    kw = (call_kwargs(node) or {})
    x = kw.get("input", kw.get("self"))
    val = meta_val(x) if isinstance(x, Node) else None
    if not isinstance(val, torch.Tensor) or not _static(val.shape) or val.dim() == 0:
        return None
    dim = kw.get("dim", 0) % val.dim()
    start, end, step = kw.get("start"), kw.get("end"), kw.get("step", 1)
    size = val.shape[dim]
    if step == 1 and start in (None, 0) and (end is None or (isinstance(end, int) and end >= size)):
        return x, "alias", False
    return None






def _static(shape: Any) -> bool:
    return all(isinstance(d, int) for d in shape)


def _same_tensor_type(node: Node, source: Node, strides: bool = False) -> bool:
    """Whether ``node``'s result has exactly ``source``'s dtype, device and (static) shape."""
    out, inp = meta_val(node), meta_val(source)
    if not isinstance(out, torch.Tensor) or not isinstance(inp, torch.Tensor):
        return False
    if not (_static(out.shape) and _static(inp.shape)):
        return False
    same = (out.dtype == inp.dtype and out.device == inp.device
            and tuple(out.shape) == tuple(inp.shape))
    if same and strides:
        same = _static(out.stride()) and _static(inp.stride()) and out.stride() == inp.stride()
    return same


def _is_number(value: Any, expected: int) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == expected


def _result_is_private(node: Node) -> bool:
    """True when no user writes into ``node``'s result and it is not a graph output."""
    for user in node.users:
        if user.op == "output":
            return False
        if user.op == "call_method" and str(user.target).endswith("_"):
            return False
        if user.op == "call_function":
            name = getattr(user.target, "__name__", "")
            if name in _INPLACE_OPERATORS:
                return False
            schema = getattr(user.target, "_schema", None)
            if schema is not None and _writes_to(schema, user, node):
                return False
    return True


def _writes_to(schema: torch.FunctionSchema, user: Node, node: Node) -> bool:
    for i, arg in enumerate(schema.arguments):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        value = user.args[i] if i < len(user.args) else user.kwargs.get(arg.name)
        if value is node:
            return True
    return False
