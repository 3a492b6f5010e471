"""Place fp16/bf16 casts in an ATen graph: the chosen ops run in low precision, sensitive ones in
fp32, every other op in the precision of its inputs; a cast only where a value crosses regions.

    x ─ linear ─ gelu ─ linear ─ add(x) ─ layer_norm                        (all fp32)
                                  ⟶
    x ─ to(bf16) ─ linear ─ gelu ─ linear ─ to(fp32) ─ add(x) ─ layer_norm
                      (weights stored once in bf16 when every use of them is bf16)
"""

from __future__ import annotations

import math
import operator
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.fx import GraphModule, Interpreter, Node
from torch.fx.node import map_arg
from torch.utils import _pytree as pytree

from . import ops
from .graph import attr, fresh_name, meta_val
from .merge_linear import MERGED_FROM

aten = torch.ops.aten
_CAST = aten._to_copy.default
_SHORT_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16"}


@dataclass(frozen=True)
class CastPlan:
    """What ``apply_casts`` did.

    Args:
        low_nodes: every node now computing in low precision (chosen ops and their followers).
        casts: cast nodes inserted.
        params_stored_low: parameters and buffers stored once in low precision.
        clamped: casts of attention masks clamped into the low precision's range first.
    """

    low_nodes: frozenset[str]
    casts: int
    params_stored_low: int
    clamped: int = 0


def is_aten_graph(gm: GraphModule) -> bool:
    """A ``torch.export`` graph: ATen calls only, no submodule calls (the pass's input form)."""
    nodes = [n for n in gm.graph.nodes if n.op in ("call_function", "call_module",
                                                    "call_method")]
    return all(n.op == "call_function" for n in nodes) and any(
        isinstance(n.target, torch._ops.OpOverload) for n in nodes)


def float32_out(node: Node) -> bool:
    return _dtype(meta_val(node)) == torch.float32


def candidates(gm: GraphModule, targets: frozenset[Any] = ops.COSTLY.aten) -> list[Node]:
    """Compute-heavy nodes whose output and floating inputs are fp32 (nothing else is cast)."""
    pinned = pinned_nodes(gm)
    found = []
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target not in targets or node in pinned:
            continue
        inputs = [a for a in _tensor_inputs(node) if _dtype(meta_val(a)) is not None]
        floats = [a for a in inputs if _dtype(meta_val(a)).is_floating_point]
        if float32_out(node) and all(_dtype(meta_val(a)) == torch.float32 for a in floats):
            found.append(node)
    return found


def functionalize_inplace(gm: GraphModule) -> int:
    """Replace ``relu_(x)``-style in-place ops by their out-of-place form where no one else can
    see the write: ``x`` is a fresh result (not an input, attribute or view) used only here.
    The casts then never have to follow a mutation. Returns how many were replaced."""
    replaced = 0
    for node in list(gm.graph.nodes):
        functional = _functional_variant(node)
        if functional is None or not node.args or not isinstance(node.args[0], Node):
            continue
        source = node.args[0]
        # Safety: the written tensor is private to this op.
        if (source.op != "call_function" or len(source.users) != 1 or _is_alias(source)
                or _mutated(source)):
            continue
        with gm.graph.inserting_before(node):
            new = gm.graph.call_function(functional, node.args, node.kwargs)
        new.meta = dict(node.meta)
        node.replace_all_uses_with(new)
        gm.graph.erase_node(node)
        replaced += 1
    return replaced


def pinned_nodes(gm: GraphModule) -> set[Node]:
    """Values an op writes to in place, with the tensors they are views of: their dtype must
    not change, or the write would land in a copy."""
    pinned: set[Node] = set()
    for node in gm.graph.nodes:
        for written in _mutated(node):
            while isinstance(written, Node) and written not in pinned:
                pinned.add(written)
                written = written.args[0] if _is_alias(written) and written.args else None
    return pinned


def apply_casts(gm: GraphModule, low: Iterable[str], dtype: torch.dtype, *,
                store_params: bool, wide: Collection[str] = (),
                mixed: Collection[Any] = ()) -> CastPlan:
    """Rewrite ``gm`` in place so the nodes named in ``low`` compute in ``dtype``.

    Args:
        gm: an ATen graph module (``is_aten_graph``), in-place ops already functionalized.
        low: names of the candidate nodes to run in ``dtype``.
        dtype: ``torch.bfloat16`` or ``torch.float16``.
        store_params: store a parameter once in ``dtype`` where every use of it is low
            precision (inference); otherwise cast it inside the graph, so that gradients reach
            the fp32 parameter (training: fp32 master weights).
        wide: nodes holding values ``dtype`` cannot (``out_of_range``): they stay fp32, and
            where one is an attention mask of a low-precision op it is clamped into range.
        mixed: op targets that take their first input in ``dtype`` where it arrives so, and
            every other argument (weights, statistics) as it is: a training BatchNorm, which
            computes in fp32 inside (``precision_policy.MIXED_INPUT``).
    """
    low, wide = set(low), set(wide)
    pinned = pinned_nodes(gm)
    region = _regions(gm, low, dtype, pinned, wide, mixed)
    original = {n: _dtype(meta_val(n)) for n in gm.graph.nodes}  # before any meta changes
    params_low = _params_to_store(gm, region, pinned, wide) if store_params else set()
    stored = _store_params(gm, params_low, dtype)
    new_dtype: dict[Node, torch.dtype | None] = {}  # per node: its output dtype after rewriting
    casts: dict[tuple[Node, torch.dtype], Node] = {}
    count = clamps = 0

    def out_dtype(n: Node) -> torch.dtype | None:
        return new_dtype.get(n, original.get(n))

    def cast(source: Node, to: torch.dtype, user: Node) -> Node:
        nonlocal count, clamps
        key = (source, to)
        shared = source not in pinned  # a written value is cast where it is read
        if shared and key in casts:
            return casts[key]
        if not shared:
            where = gm.graph.inserting_before(user)
        elif source.op == "placeholder":
            last = [n for n in gm.graph.nodes if n.op == "placeholder"][-1]
            where = gm.graph.inserting_after(last)
        else:
            where = gm.graph.inserting_after(source)
        value = meta_val(source)
        source_of_cast = source
        if source.name in wide and to != torch.float32:
            source_of_cast = _insert_saturation(gm, source, to, where)
            where = gm.graph.inserting_after(source_of_cast)
            clamps += 1
        with where:
            node = gm.graph.call_function(_CAST, (source_of_cast,), {"dtype": to})
        node.meta["val"] = value.to(to) if isinstance(value, torch.Tensor) else value
        count += 1
        if shared:
            casts[key] = node
        return node

    for node in list(gm.graph.nodes):
        if node in params_low:
            new_dtype[node] = dtype
            continue
        if node.op == "output":
            _restore_outputs(node, out_dtype, original, cast)
            continue
        if node.op != "call_function" or node.target is operator.getitem:
            if node.op == "call_function":  # getitem follows its tuple's region
                target = region.get(node.args[0])
                if target is not None and float32_out(node):
                    new_dtype[node] = target
                    node.meta["val"] = _to(meta_val(node), target)
            continue
        target = region.get(node)  # None: keep the node's original dtypes
        for arg in _tensor_inputs(node):
            have = out_dtype(arg)
            want = target if target is not None else original.get(arg)
            if target is not None and node.target in mixed and arg is not node.args[0]:
                want = original.get(arg)
            if have is None or want is None or have == want:
                continue
            if not (have.is_floating_point and want.is_floating_point):
                continue
            node.replace_input_with(arg, cast(arg, want, node))
        if target is not None and float32_out(node):
            new_dtype[node] = target
            node.meta["val"] = _to(meta_val(node), target)
        elif target is not None and _is_tuple_of_float32(node):
            node.meta["val"] = _to(meta_val(node), target)
    low_nodes = frozenset(n.name for n, d in region.items() if d == dtype)
    return CastPlan(low_nodes, count, stored, clamps)


class CastInterpreter(Interpreter):
    """Runs ``gm`` as ``apply_casts(gm, low, dtype)`` would rewrite it, without rewriting it:
    the cheap way to measure many candidate sets.

    Args:
        gm: the fp32 graph module (in-place ops already functionalized).
        low: names of the candidate nodes to run in ``dtype``.
        dtype: the low precision.
        params: low-precision copies of attributes, by attribute name, shared across runs.
        wide: nodes holding values ``dtype`` cannot (``out_of_range``).
        mixed: op targets whose first input alone follows the region (``apply_casts``).
    """

    def __init__(self, gm: GraphModule, low: Iterable[str], dtype: torch.dtype,
                 params: dict[str, torch.Tensor], wide: Collection[str] = (),
                 mixed: Collection[Any] = ()) -> None:
        super().__init__(gm)
        self.wide = set(wide)
        self.mixed = frozenset(mixed)
        self.region = _regions(gm, set(low), dtype, pinned_nodes(gm), self.wide, self.mixed)
        self.original = {n: _dtype(meta_val(n)) for n in gm.graph.nodes}
        self.params = params

    def run_node(self, n: Node) -> Any:
        if n.op == "output":
            return self.output(n.target, map_arg(n.args, lambda a: self._load(a, None)), {})
        if n.op != "call_function" or n.target is operator.getitem:
            return super().run_node(n)
        target = self.region.get(n)
        if target is not None and n.target in self.mixed:  # the first input alone follows
            rest = map_arg(n.args[1:], lambda a: self._load(a, None))
            args = (map_arg(n.args[0], lambda a: self._load(a, target)), *rest)
            kwargs = map_arg(n.kwargs, lambda a: self._load(a, None))
            return self.call_function(n.target, args, kwargs)
        args = map_arg(n.args, lambda a: self._load(a, target))
        kwargs = map_arg(n.kwargs, lambda a: self._load(a, target))
        return self.call_function(n.target, args, kwargs)

    def _load(self, arg: Node, target: torch.dtype | None) -> Any:
        """``arg``'s value as the consumer sees it: in ``target`` (its region's dtype), or in
        the dtype the original graph gave it."""
        value = self.env[arg]
        want = target if target is not None else self.original.get(arg)
        if (not isinstance(value, torch.Tensor) or want is None or value.dtype == want
                or not (value.is_floating_point() and want.is_floating_point)):
            return value
        if arg.op == "get_attr":
            key = f"{arg.target}|{want}"
            if key not in self.params:
                self.params[key] = _lowered(value.detach(), want, arg.name in self.wide)
            return self.params[key]
        return _lowered(value, want, arg.name in self.wide)


def _lowered(value: torch.Tensor, dtype: torch.dtype, wide: bool) -> torch.Tensor:
    """``value`` in ``dtype``; a wide value (an attention mask) saturated first, as
    ``apply_casts`` does."""
    if wide and dtype != torch.float32:
        bound = torch.finfo(dtype).max
        value = torch.where(value.isinf(), value, value.clamp(-bound, bound))
    return value.to(dtype)


def _insert_saturation(gm: GraphModule, source: Node, dtype: torch.dtype, where: Any) -> Node:
    """Insert ``where(isinf(x), x, clamp(x, -max, max))`` at ``where``: ``x`` (an additive
    mask) clamped into ``dtype``'s range so that ``finfo(float32).min`` does not become -inf,
    while the infinities fp32 itself computes (as eager would) stay."""
    bound = torch.finfo(dtype).max
    value = meta_val(source)
    with where:
        clamped = gm.graph.call_function(aten.clamp.default, (source, -bound, bound))
    with gm.graph.inserting_after(clamped):
        infinite = gm.graph.call_function(aten.isinf.default, (source,))
    with gm.graph.inserting_after(infinite):
        saturated = gm.graph.call_function(aten.where.self, (infinite, source, clamped))
    clamped.meta["val"] = saturated.meta["val"] = value
    if isinstance(value, torch.Tensor):
        infinite.meta["val"] = torch.isinf(value)
    return saturated


# --- regions ---------------------------------------------------------------------------------


def _regions(gm: GraphModule, low: set[str], dtype: torch.dtype, pinned: set[Node],
             wide: Collection[str] = (), mixed: Collection[Any] = ()) -> dict[Node, torch.dtype]:
    """The compute dtype of each call node that changes (absent: keeps its original dtypes).

    Chosen candidates run in ``dtype``, the other candidates and sensitive ops in fp32 (one
    kept in fp32 by measurement must not follow a low input); other ops on fp32 values follow
    their inputs: low when some input is low and none is an fp32 activation (parameters and
    constants can be cast either way), so regions grow without casts between neighbours.
    Ops holding values ``dtype`` cannot (``wide``: a mask fill of ``finfo(float32).min``) stay
    fp32. A ``mixed`` op follows its first input alone (its weights and statistics stay fp32).
    """
    region: dict[Node, torch.dtype] = {}
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target is operator.getitem or node in pinned:
            continue
        if node.name in wide:
            continue
        if not (float32_out(node) or _is_tuple_of_float32(node)) or _mutated(node):
            continue
        if _explicit_dtype(node):  # the model asked for this dtype itself
            continue
        if node.name in low:
            region[node] = dtype
            continue
        if node.target in ops.COSTLY.aten:  # a candidate not chosen: fp32, whatever feeds it
            continue
        if node.target in mixed:
            first = node.args[0] if node.args else None
            if isinstance(first, Node) and region.get(first) == dtype:
                region[node] = dtype
            continue
        if node.target in ops.SENSITIVE.aten:
            continue
        seen = set()
        for arg in _tensor_inputs(node):
            arg_dtype = region.get(arg, _dtype(meta_val(arg)))
            if arg.op == "call_function" and arg.target is operator.getitem:
                arg_dtype = region.get(arg.args[0], arg_dtype) if float32_out(arg) else None
            if arg.op == "get_attr" or arg_dtype is None or not arg_dtype.is_floating_point:
                continue
            seen.add(arg_dtype)
        if seen == {dtype}:
            region[node] = dtype
    return region


def _params_to_store(gm: GraphModule, region: dict[Node, torch.dtype], pinned: set[Node],
                     wide: Collection[str] = ()) -> set[Node]:
    """Attribute nodes holding fp32 tensors whose every user computes in low precision (and
    whose values the low precision holds). Where only some users do, those read a node of
    their own, stored low: a tied weight (GPT-2's output head is its token embedding, which
    stays fp32) was cast to bf16 in the graph at every call, reading 154 MB and writing 77 MB
    a decode step, and bf16 decoded at 0.77x eager's tokens/s; a low copy costs half the
    weight's memory once."""
    chosen = set()
    for node in list(gm.graph.nodes):
        if node.op != "get_attr" or node in pinned or not float32_out(node) or node.name in wide:
            continue
        if not isinstance(attr(gm, node), torch.Tensor):
            continue
        users = list(node.users)
        low = [u for u in users if u in region and u.target is not operator.getitem]
        if users and len(low) == len(users):
            chosen.add(node)
        elif low:
            with gm.graph.inserting_after(node):
                copy = gm.graph.get_attr(str(node.target))
            copy.meta = dict(node.meta)
            for user in low:
                user.replace_input_with(node, copy)
            chosen.add(copy)
    return chosen


def _store_params(gm: GraphModule, nodes: set[Node], dtype: torch.dtype) -> int:
    done: dict[str, str] = {}  # original attribute -> its low-precision copy
    for node in nodes:
        target = str(node.target)
        if target not in done:
            value = attr(gm, node).detach()
            # A weight read only as a matmul's right side ((in, out): GPT-2's Conv1D) is stored
            # as its transpose laid out row by row: the (out, in) rows that a decode step's
            # GEMV streams (``packed_kernels.rows_kernel_fits``) at no extra memory, where
            # copying the transposed view would double the low-precision weights. Matmuls
            # take either layout.
            value = (value.t().to(dtype, memory_format=torch.contiguous_format).t()
                     if _right_side_only(node, value)
                     else value.to(dtype))
            name = fresh_name(gm, target.replace(".", "_") + "_" + str(dtype).split(".")[-1])
            gm.register_buffer(name, value)
            done[target] = name
        node.target = done[target]
        node.meta["val"] = _to(meta_val(node), dtype)
        # A merged weight stored low is a tensor of its own now, not the concatenation of the
        # user's fp32 weights the driver would read it as again.
        node.meta.pop(MERGED_FROM, None)
    return len(done)


def _right_side_only(node: Node, value: torch.Tensor) -> bool:
    """Whether the 2-D constant ``node`` is read by ``mm``/``addmm`` as their weight alone."""
    return value.dim() == 2 and bool(node.users) and all(
        (user.target in ops.MM.aten and user.args[1:2] == (node,) and node not in user.args[:1])
        or (user.target in ops.ADDMM.aten and user.args[2:3] == (node,)
            and node not in user.args[:2])
        for user in node.users)


def _restore_outputs(output: Node, out_dtype: Any, original: dict[Node, Any], cast: Any,
                     ) -> None:
    """Graph outputs keep the dtype the model returned."""
    for arg in list(output.all_input_nodes):
        have, want = out_dtype(arg), original.get(arg)
        if have is not None and want is not None and have != want:
            output.replace_input_with(arg, cast(arg, want, output))


# --- range -----------------------------------------------------------------------------------


def out_of_range(gm: GraphModule, dtype: torch.dtype, example_inputs: Sequence[Any] = (),
                 ) -> dict[str, float]:
    """Nodes whose values ``dtype`` cannot hold, or holds so near its limit that one more
    addition overflows: node name -> the largest magnitude found.

    Sources are scalar arguments (``masked_fill(x, m, finfo(float32).min)``, ``(1 - mask) *
    -1e9``), constant tensors and example inputs; from them the magnitude carries on through
    every op that can pass it on, and stops at bounded ones (softmax, norms) and at an
    attention's mask argument. Only a source is seen, not a value an op computes: an overflow
    of that kind is left to measurement.
    """
    limit = torch.finfo(dtype).max / 2
    examples = dict(zip((n for n in gm.graph.nodes if n.op == "placeholder"), example_inputs,
                        strict=False))
    wide: dict[str, float] = {}
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            magnitude = _magnitude(examples.get(node))
        elif node.op == "get_attr":
            magnitude = _magnitude(attr(gm, node))
        elif node.op == "call_function" and _floating_out(node):
            magnitude = max(_scalar_magnitudes(node), default=0.0)
            if node.target not in ops.BOUNDED.aten:
                magnitude = max([magnitude] + [wide.get(a.name, 0.0) for a in _carried(node)])
        else:
            continue
        if magnitude > limit:
            wide[node.name] = magnitude
    return wide


def range_refusal(node: Node, wide: Mapping[str, float], dtype: torch.dtype) -> str | None:
    """Why candidate ``node`` cannot compute in ``dtype`` given ``out_of_range``'s answer, or
    None when it can."""
    name = _SHORT_NAMES.get(dtype, str(dtype))
    if node.name in wide:
        return (f"holds values of magnitude {wide[node.name]:.3g}, beyond what {name} holds "
                f"(max {torch.finfo(dtype).max:.3g})")
    mask = attention_mask(node)
    if mask is not None and mask.name in wide and not saturates(dtype):
        return (f"its mask {mask.name} holds {wide[mask.name]:.3g}, which {name} (max "
                f"{torch.finfo(dtype).max:.3g}) cannot hold, nor clamp without changing the "
                f"attention of masked rows")
    return None


def saturates(dtype: torch.dtype) -> bool:
    """Whether an additive mask of fp32's magnitude can be clamped to ``dtype``'s limit and
    stay the same mask: bf16's limit (3.39e38) still swamps every score, so fully masked rows
    still attend uniformly; fp16's (65504) does not: scores + mask round to -inf or keep their
    differences."""
    return torch.finfo(dtype).max >= torch.finfo(torch.float32).max / 2


def attention_mask(node: Node) -> Node | None:
    """The additive mask argument of an attention node, if any."""
    slot = ops.ATTENTION_MASK_ARG.get(node.target)
    if slot is None:
        return None
    index, key = slot
    value = node.args[index] if index < len(node.args) else node.kwargs.get(key)
    return value if isinstance(value, Node) else None


def _carried(node: Node) -> list[Node]:
    """The inputs whose magnitude can reach ``node``'s output."""
    mask = attention_mask(node)
    return [a for a in node.all_input_nodes if a is not mask]


def _magnitude(value: Any) -> float:
    """The largest finite magnitude in a floating tensor (infinities every float type holds)."""
    if not (isinstance(value, torch.Tensor) and value.is_floating_point() and value.numel()):
        return 0.0
    if isinstance(value, torch._subclasses.FakeTensor) or value.device.type == "meta":
        return 0.0
    largest = float(value.detach().abs().amax())
    if math.isfinite(largest):  # the common case: one pass over the weights, no copy kept
        return largest
    return float(value.detach().abs().nan_to_num(0.0, posinf=0.0).amax())


def _scalar_magnitudes(node: Node) -> list[float]:
    """The magnitudes of the numbers ``node`` computes with (fill values, factors), not of
    sizes or dims."""
    schema = _schema(node)
    if schema is None:
        return []
    found = []
    for i, argument in enumerate(schema.arguments):
        value = node.args[i] if i < len(node.args) else node.kwargs.get(argument.name)
        kind = argument.type
        if isinstance(kind, torch._C.OptionalType):
            kind = kind.getElementType()
        if (isinstance(value, (int, float)) and not isinstance(value, bool)
                and isinstance(kind, (torch._C.TensorType, torch._C.NumberType,
                                      torch._C.FloatType)) and math.isfinite(value)):
            found.append(abs(float(value)))
    return found


def _floating_out(node: Node) -> bool:
    values = pytree.tree_leaves(meta_val(node))
    return any(isinstance(v, torch.Tensor) and v.is_floating_point() for v in values)


# --- node facts ------------------------------------------------------------------------------


def _tensor_inputs(node: Node) -> list[Node]:
    return [a for a in node.all_input_nodes if isinstance(meta_val(a), torch.Tensor)]


def _dtype(value: Any) -> torch.dtype | None:
    return value.dtype if isinstance(value, torch.Tensor) else None


def _is_tuple_of_float32(node: Node) -> bool:
    value = meta_val(node)
    return (isinstance(value, (tuple, list)) and bool(value)
            and all(_dtype(v) == torch.float32 for v in value))


def _to(value: Any, dtype: torch.dtype) -> Any:
    return pytree.tree_map_only(
        torch.Tensor, lambda t: t.to(dtype) if t.dtype == torch.float32 else t, value)


def _schema(node: Node) -> Any:
    target = node.target
    return target._schema if isinstance(target, torch._ops.OpOverload) else None


def _explicit_dtype(node: Node) -> bool:
    """Whether the call names its result's dtype (``to(torch.float32)``, ``full(dtype=)``)."""
    schema = _schema(node)
    if schema is None:
        return node.kwargs.get("dtype") is not None
    for i, argument in enumerate(schema.arguments):
        if argument.name == "dtype":
            value = node.args[i] if i < len(node.args) else node.kwargs.get("dtype")
            return value is not None
    return False


def _mutated(node: Node) -> list[Node]:
    """The argument nodes ``node`` writes to in place (by its schema)."""
    schema = _schema(node)
    if node.op != "call_function" or schema is None or not schema.is_mutable:
        return []
    written = []
    for i, argument in enumerate(schema.arguments):
        if argument.alias_info is None or not argument.alias_info.is_write:
            continue
        value = node.args[i] if i < len(node.args) else node.kwargs.get(argument.name)
        if isinstance(value, Node):
            written.append(value)
    return written


def _is_alias(node: Node) -> bool:
    """Whether ``node``'s result may share memory with its first input (views, detach)."""
    schema = _schema(node)
    return bool(schema is not None and schema.returns
                and schema.returns[0].alias_info is not None and not schema.is_mutable)


def _functional_variant(node: Node) -> Any:
    """``aten.relu.default`` for ``aten.relu_.default``: the out-of-place twin of an in-place
    op (same arguments), or None."""
    schema = _schema(node)
    if schema is None or not schema.is_mutable:
        return None
    name = schema.name.split("::")[-1]
    if not name.endswith("_") or name.startswith("_"):
        return None
    packet = getattr(aten, name[:-1], None)
    overload = getattr(packet, node.target._overloadname, None) if packet is not None else None
    if overload is None or overload._schema.is_mutable:
        return None
    return overload
