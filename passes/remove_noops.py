"""Remove ops that compute nothing: eval-mode dropout, identity modules, x*1, x+0, and views or
casts that leave their input as it was.

    x ─ dropout(train=False) ─ mul(·, 1) ─ view(same shape) ─ y      ⟶      x ─ y
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.fx import GraphModule, Node

from . import ops
from .base import PassContext, PassResult
from .graph import attr, call_kwargs, meta_val


@dataclass(frozen=True)
class _Rule:
    """One identity: a call of ``pattern`` equals its input where ``identity`` finds it.

    ``identity`` is the rule's condition and replacement in one: it returns the input node the
    call equals (None when the condition does not hold). ``kind`` is the count it adds to;
    ``makes_new_tensor`` says the op returns a new tensor rather than its input or an alias,
    so that replacing it by its input is only safe where nobody writes into or returns it.
    """

    pattern: ops.OpSet
    identity: Callable[[Node], Node | None]
    kind: str
    makes_new_tensor: bool = False


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
        rule = next((r for r in _RULES if _matches(gm, node, r.pattern)), None)
        source = rule.identity(node) if rule is not None else None
        if source is None:
            continue
        if rule.makes_new_tensor and not _result_is_private(node):
            continue
        node.replace_all_uses_with(source)
        gm.graph.erase_node(node)
        counts[rule.kind] += 1
    if counts:
        gm.recompile()
    return PassResult(gm, bool(counts), dict(counts))


def _matches(gm: GraphModule, node: Node, pattern: ops.OpSet) -> bool:
    """Function calls by target, module calls by class (subclasses included: a user's dropout
    subclass is still dropout). Method calls are left alone: the rules read arguments by their
    ATen or functional names, which ``x.view(*shape)`` does not have."""
    if node.op == "call_function":
        return node.target in pattern.functions
    if node.op == "call_module" and pattern.modules:
        return isinstance(attr(gm, node.target), pattern.modules)
    return False


def _module_input(node: Node) -> Node | None:
    """The one input a module is called on (``module(x)``), None for any other call."""
    if len(node.args) != 1 or node.kwargs or not isinstance(node.args[0], Node):
        return None
    return node.args[0]


def _identity_module(node: Node) -> Node | None:
    return _module_input(node)


def _eval_dropout(node: Node) -> Node | None:
    """Dropout when not training or with p == 0. Eager dropout then returns its input itself,
    so the call is an alias."""
    if node.op == "call_module":
        module = node.graph.owning_module.get_submodule(str(node.target))
        return _module_input(node) if not module.training or module.p == 0 else None
    kw = (call_kwargs(node) or {})
    x = kw.get("input")
    training = kw.get("train", kw.get("training", True))
    if isinstance(x, Node) and (training is False or kw.get("p") == 0) and _same_tensor_type(
            node, x):
        return x
    return None


def _same_type_cast(node: Node) -> Node | None:
    """``x.to(...)`` that changes neither dtype, device nor layout and is not asked to copy."""
    kw = (call_kwargs(node) or {})
    x = kw.get("input", kw.get("self"))
    if (isinstance(x, Node) and not kw.get("copy", False)
            and kw.get("memory_format") in (None, torch.preserve_format)
            and _same_tensor_type(node, x, strides=True)):
        return x
    return None


def _already_contiguous(node: Node) -> Node | None:
    """``contiguous`` on a tensor of static shape already in the asked memory format."""
    x = node.args[0] if node.args else None
    val = meta_val(x) if isinstance(x, Node) else None
    fmt = (call_kwargs(node) or {}).get("memory_format", torch.contiguous_format)
    if (isinstance(val, torch.Tensor) and isinstance(fmt, torch.memory_format)
            and _static(val.shape) and val.is_contiguous(memory_format=fmt)):
        return x
    return None


def _same_view(node: Node) -> Node | None:
    """A view, reshape or expand whose result has its input's shape and strides."""
    x = node.args[0] if node.args else None
    if isinstance(x, Node) and _same_tensor_type(node, x, strides=True):
        return x
    return None


def _identity_permutation(node: Node) -> Node | None:
    """``permute`` with the dimensions in their own order."""
    x, dims = node.args[0], node.args[1]
    val = meta_val(x) if isinstance(x, Node) else None
    if isinstance(val, torch.Tensor) and [d % max(val.dim(), 1) for d in dims] == list(
            range(val.dim())):
        return x
    return None


def _proven_assert(node: Node) -> Node | None:
    """An ``_assert_tensor_metadata`` that the input's metadata already proves. It has no
    result, so it is "replaced" by its input and erased."""
    kw = (call_kwargs(node) or {})
    x = kw.get("input", kw.get("a", node.args[0] if node.args else None))
    val = meta_val(x) if isinstance(x, Node) else None
    if not isinstance(val, torch.Tensor) or node.users:
        return None
    expected = {"dtype": val.dtype, "device": val.device, "layout": val.layout}
    if all(kw.get(k) in (None, v) for k, v in expected.items()):
        return x
    return None


def _arithmetic_identity(node: Node) -> Node | None:
    """``x * 1``, ``1 * x``, ``x / 1``, ``x + 0``, ``0 + x``, ``x - 0`` with the result of x's
    type, and no keyword argument but ``alpha=1`` (``rounding_mode`` floors or truncates)."""
    target = node.target
    if len(node.args) != 2 or set(node.kwargs) - {"alpha"}:
        return None
    a, b = node.args
    commutative = target in ops.MULTIPLY.functions or target in ops.ADD.functions
    neutral = 1 if (target in ops.MULTIPLY.functions or target in ops.DIVIDE.functions) else 0
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
    return source


def _full_slice(node: Node) -> Node | None:
    """``x[a:b]`` along one dim that starts at 0, steps by 1 and ends at or past its size."""
    kw = (call_kwargs(node) or {})
    x = kw.get("input", kw.get("self"))
    val = meta_val(x) if isinstance(x, Node) else None
    if not isinstance(val, torch.Tensor) or not _static(val.shape) or val.dim() == 0:
        return None
    dim = kw.get("dim", 0) % val.dim()
    start, end, step = kw.get("start"), kw.get("end"), kw.get("step", 1)
    size = val.shape[dim]
    if step == 1 and start in (None, 0) and (end is None or (isinstance(end, int) and end >= size)):
        return x
    return None


def _aten(op_set: ops.OpSet) -> ops.OpSet:
    """The ATen part of a family: these rules read ATen's argument layout (``view(x, shape)``),
    which torch-level spellings spread differently (``x.view(*shape)``)."""
    return ops.OpSet(op_set.aten)


# The identities, tried in order; the first whose pattern a node calls decides.
_RULES: tuple[_Rule, ...] = (
    _Rule(ops.IDENTITY, _identity_module, "identity"),
    _Rule(ops.DROPOUT, _eval_dropout, "dropout"),
    _Rule(ops.BINARY_ARITHMETIC, _arithmetic_identity, "arithmetic", makes_new_tensor=True),
    _Rule(_aten(ops.TO), _same_type_cast, "alias"),
    _Rule(_aten(ops.CONTIGUOUS), _already_contiguous, "alias"),
    _Rule(_aten(ops.RESHAPE | ops.EXPAND), _same_view, "alias"),
    _Rule(_aten(ops.PERMUTE), _identity_permutation, "alias"),
    _Rule(_aten(ops.SLICE), _full_slice, "alias"),
    _Rule(_aten(ops.ASSERT_METADATA), _proven_assert, "assert"),
)


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
            if user.target in ops.INPLACE_OPERATORS.functions:  # `y += 1`, `y[0] = 1`
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
