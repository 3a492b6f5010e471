"""The input signature a captured graph is valid for.

A graph bakes in what was constant at capture: the input structure, static shapes, dtypes,
devices, non-tensor argument values, train/eval modes, grad mode and, with gradients on,
which inputs and parameters require them. A dynamic graph (``dynamic=True``) holds for the
sizes ``torch.export`` proved it for: each symbolic dimension's range and every guard export
recorded between them (``2*s0 <= s1``; the branch a size took). A call whose signature differs
is re-captured (or runs eagerly), never replayed on a stale graph. Keyword arguments match in
any order.
"""

from __future__ import annotations

import dataclasses
import logging
import operator
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.fx import GraphModule
from torch.utils import _pytree as pytree

log = logging.getLogger(__name__)

_TRAINING = operator.attrgetter("training")  # read in C for every submodule on every call


@dataclass(frozen=True)
class TensorSpec:
    dtype: torch.dtype
    device: torch.device
    shape: tuple[int | None, ...]  # None where the graph is dynamic in that dimension
    # With gradients on, whether the input required them (a graph captured for an input that
    # did not may use kernels without a backward); None: captured without gradients.
    requires_grad: bool | None = None

    def matches(self, t: torch.Tensor) -> bool:
        return (t.dtype == self.dtype and t.device == self.device and t.dim() == len(self.shape)
                and all(s is None or s == d for s, d in zip(self.shape, t.shape, strict=True))
                and (self.requires_grad is None or t.requires_grad == self.requires_grad))

    def __str__(self) -> str:
        dims = ", ".join("?" if d is None else str(d) for d in self.shape)
        return f"{str(self.dtype).replace('torch.', '')}[{dims}]"


@dataclass(frozen=True)
class InputSignature:
    """Structure and per-leaf specs of ``(args, kwargs)`` plus the modes the graph assumed."""

    tree: pytree.TreeSpec
    leaves: tuple[Any, ...]  # TensorSpec for tensors, the value itself otherwise
    modes: tuple[Any, ...]
    flat_keys: tuple[str, ...] | None = None  # sorted kwargs names when no input is a container
    shapes: SymbolicShapes | None = None  # what a dynamic graph assumes of its free sizes

    def matches(self, args: tuple[Any, ...], kwargs: Mapping[str, Any],
                modes: tuple[Any, ...]) -> bool:
        if modes != self.modes:
            return False
        if len(kwargs) > 1:
            kwargs = _sorted(kwargs)
        leaves = _flat_leaves(args, kwargs) if self.flat_keys is not None else None
        if leaves is not None:
            # Fast path (no containers among the inputs): pytree's flatten costs more than a
            # small model's forward.
            if len(args) + len(kwargs) != len(self.leaves) or tuple(kwargs) != self.flat_keys:
                return False
        else:
            leaves, tree = pytree.tree_flatten((tuple(args), dict(kwargs)))
            if tree != self.tree or len(leaves) != len(self.leaves):
                return False
        for spec, value in zip(self.leaves, leaves, strict=True):
            if isinstance(spec, TensorSpec):
                if not isinstance(value, torch.Tensor) or not spec.matches(value):
                    return False
            elif isinstance(value, torch.Tensor) or not same_value(spec, value):
                return False
        return self.shapes is None or self.shapes.hold(leaves)

    def matches_any_grad(self, args: tuple[Any, ...], kwargs: Mapping[str, Any],
                         modes: tuple[Any, ...]) -> bool:
        """``matches`` but for the grad mode and which tensors require gradients: what an
        exported graph, before the passes, does not depend on (its ops are differentiable
        either way; the passes decide what may be folded for the mode)."""
        relaxed = dataclasses.replace(
            self, modes=(False, (), *self.modes[2:]),
            leaves=tuple(dataclasses.replace(s, requires_grad=None)
                         if isinstance(s, TensorSpec) else s for s in self.leaves))
        return relaxed.matches(args, kwargs, (False, (), *modes[2:]))

    def describe(self) -> str:
        parts = [str(s) if isinstance(s, TensorSpec) else repr(s) for s in self.leaves]
        return ", ".join(parts) if parts else "(no inputs)"


def same_value(a: Any, b: Any) -> bool:
    if a is b:
        return True
    if type(a) is not type(b):
        return False
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - incomparable values count as different
        return False


def _sorted(kwargs: Mapping[str, Any]) -> dict[str, Any]:
    return dict(sorted(kwargs.items()))


def current_modes(module: nn.Module, submodules: list[nn.Module] | None = None,
                  parameters: list[torch.Tensor] | None = None,
                  training: tuple[bool, ...] | None = None) -> tuple[Any, ...]:
    """Grad mode, with gradients on which parameters require them, autocast (a graph
    traced without it computes in fp32, one traced under it has its casts baked in), and
    every submodule's ``training`` flag (``training_flags``; pass them where they are known
    to be current). (A graph captured without grad runs as well under ``inference_mode``;
    one captured with grad keeps parameter gradients.)"""
    if training is None:
        training = training_flags(module.modules() if submodules is None else submodules)
    grad = torch.is_grad_enabled()
    if grad:  # which parameters a gradient reaches: a frozen one may be folded into the graph
        params = module.parameters() if parameters is None else parameters
        wants_grad = tuple(p.requires_grad for p in params)
    else:
        wants_grad = ()
    return (grad, wants_grad, _autocast(), *training)


def training_flags(modules: Iterable[nn.Module]) -> tuple[bool, ...]:
    """Each module's ``training`` flag, in order."""
    return tuple(map(_TRAINING, modules))


def _autocast() -> tuple[tuple[str, torch.dtype], ...]:
    return tuple((device, torch.get_autocast_dtype(device)) for device in ("cpu", "cuda")
                 if torch.is_autocast_enabled(device))


def needs_gradients(args: tuple[Any, ...], kwargs: Mapping[str, Any],
                    modes: tuple[Any, ...]) -> bool:
    """Whether a call in these modes can be differentiated: gradients on, and a parameter or
    an input requires them. Only then must a graph keep every op differentiable."""
    if not modes[0]:
        return False
    return any(modes[1]) or any(isinstance(x, torch.Tensor) and x.requires_grad
                           for x in pytree.tree_leaves((tuple(args), dict(kwargs))))


def signature_of(args: tuple[Any, ...], kwargs: Mapping[str, Any], module: nn.Module,
                 gm: GraphModule | None = None) -> InputSignature:
    """The signature of these inputs; dimensions the graph ``gm`` keeps symbolic are free,
    within what export proved for them."""
    shapes = None
    if gm is not None:  # the graph's placeholders follow the keywords' order at capture
        try:
            shapes = SymbolicShapes.of(gm, pytree.tree_leaves((tuple(args), dict(kwargs))))
        except Exception as exc:  # noqa: BLE001 - unreadable guards: fixed sizes are safe
            log.info("dynamic shape guards not readable (%s); the graph is used at the "
                     "example's sizes only", exc)
    order = _sorted(kwargs)
    if shapes is not None and list(order) != list(kwargs):
        shapes = shapes.reindexed(_permutation((tuple(args), dict(kwargs)), (tuple(args), order)))
    kwargs = order
    leaves, tree = pytree.tree_flatten((tuple(args), kwargs))
    free = shapes.free if shapes is not None else {}
    grad = torch.is_grad_enabled()
    specs: list[Any] = []
    for i, value in enumerate(leaves):
        if isinstance(value, torch.Tensor):
            dims = free.get(i, set())
            shape = tuple(None if d in dims else int(s) for d, s in enumerate(value.shape))
            specs.append(TensorSpec(value.dtype, value.device, shape,
                                    value.requires_grad if grad else None))
        else:
            specs.append(value)
    flat_keys = tuple(kwargs) if _flat_leaves(args, kwargs) is not None else None
    return InputSignature(tree, tuple(specs), current_modes(module), flat_keys, shapes)


def _permutation(before: Any, after: Any) -> list[int]:
    """Where each leaf of ``before`` is among the leaves of ``after`` (the same objects)."""
    old, new = pytree.tree_leaves(before), pytree.tree_leaves(after)
    taken: set[int] = set()
    index = []
    for value in old:
        j = next(j for j, other in enumerate(new) if other is value and j not in taken)
        taken.add(j)
        index.append(j)
    return index


def _flat_leaves(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> list[Any] | None:
    """The inputs as they are when none is a container pytree would walk into, else None."""
    leaves = [*args, *kwargs.values()]
    for value in leaves:
        if isinstance(value, (list, tuple, dict)) or (
                not isinstance(value, torch.Tensor) and pytree._get_node_type(value)
                in pytree.SUPPORTED_NODES):
            return None
    return leaves


@dataclass(frozen=True)
class SymbolicShapes:
    """What a dynamic graph assumes of the sizes it keeps symbolic: each symbol's range, that
    a symbol seen in several places has one value, that derived sizes (``2*s0``) agree, and
    every guard export recorded (its shape environment's ``guards``).

    Args:
        free: leaf index -> the dimensions that may vary.
        where: (leaf, dim, symbol name) for each free dimension bound to a plain symbol.
        derived: (leaf, dim, size from the symbols) for each free dimension that is an
            expression of them.
        checks: ``fn(sizes) -> bool`` over the symbols' values, by name.
    """

    free: dict[int, set[int]]
    where: tuple[tuple[int, int, str], ...]
    derived: tuple[tuple[int, int, Callable[[dict[str, int]], int]], ...]
    checks: tuple[Callable[[dict[str, int]], bool], ...]

    def hold(self, leaves: list[Any]) -> bool:
        sizes: dict[str, int] = {}
        for leaf, dim, name in self.where:
            size = leaves[leaf].shape[dim]
            if sizes.setdefault(name, size) != size:
                return False
        try:
            return (all(int(fn(sizes)) == leaves[leaf].shape[dim]
                        for leaf, dim, fn in self.derived)
                    and all(check(sizes) for check in self.checks))
        except Exception:  # noqa: BLE001 - a guard that cannot be evaluated does not hold
            return False

    def reindexed(self, new_index: list[int]) -> SymbolicShapes:
        """The same assumptions with leaf ``i`` renumbered ``new_index[i]``."""
        return SymbolicShapes({new_index[i]: dims for i, dims in self.free.items()},
                              tuple((new_index[i], d, n) for i, d, n in self.where),
                              tuple((new_index[i], d, fn) for i, d, fn in self.derived),
                              self.checks)

    @classmethod
    def of(cls, gm: GraphModule, leaves: list[Any]) -> SymbolicShapes | None:
        """None when ``gm`` is static. A graph whose guards cannot be read (symbols bound to
        no input dimension) is treated as static: fixed sizes are always safe."""
        import sympy

        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        if len(placeholders) != len(leaves):
            return None
        free: dict[int, set[int]] = {}
        where: list[tuple[int, int, str]] = []
        derived: list[tuple[int, int, Any]] = []
        env = None
        for i, node in enumerate(placeholders):
            val = node.meta.get("val")
            if not isinstance(val, torch.Tensor):
                continue
            for d, size in enumerate(val.shape):
                if not isinstance(size, torch.SymInt):
                    continue
                expr = size.node.expr
                if expr.is_number:  # specialized to a constant: a static dimension
                    continue
                env = size.node.shape_env
                free.setdefault(i, set()).add(d)
                if isinstance(expr, sympy.Symbol):
                    where.append((i, d, expr.name))
                else:
                    derived.append((i, d, expr))
        if not free or env is None:
            return None
        bound = {name for _, _, name in where}
        checks: list[Callable[[dict[str, int]], bool]] = []
        # torch.export's own ranges where it gave them (a Dim(min=1) holds at 1, where the
        # shape environment assumed >= 2 while tracing), else the shape environment's.
        proved = {str(sym): vr for sym, vr in gm.meta.get("range_constraints", {}).items()}
        for _, _, name in where:
            vr = proved.get(name) or _range_by_name(env, name)
            if vr is not None:
                checks.append(_range_check(name, vr))
        sized: list[tuple[int, int, Callable[[dict[str, int]], int]]] = []
        for leaf, dim, expr in derived:
            if not {s.name for s in expr.free_symbols} <= bound:
                return None
            sized.append((leaf, dim, _compile(expr)))
        for guard in env.guards:
            expr = guard.expr.xreplace(env.replacements)
            if expr is sympy.true or expr == sympy.true:
                continue
            if not {s.name for s in expr.free_symbols} <= bound:
                return None
            checks.append(_compile_bool(expr))
        return cls(free, tuple(where), tuple(sized), tuple(checks))


def _range_by_name(env: Any, name: str) -> Any:
    for sym, vr in env.var_to_range.items():
        if sym.name == name:
            return vr
    return None


def _range_check(name: str, vr: Any) -> Callable[[dict[str, int]], bool]:
    def bound(value: Any) -> int | None:
        if not isinstance(value, int) and not getattr(value, "is_Integer", False):
            return None  # int_oo / -int_oo: unbounded
        return int(value)

    lo, hi = bound(vr.lower), bound(vr.upper)
    return lambda sizes: ((lo is None or sizes[name] >= lo)
                          and (hi is None or sizes[name] <= hi))


def _compile(expr: Any) -> Callable[[dict[str, int]], int]:
    import sympy

    names = sorted(s.name for s in expr.free_symbols)
    fn = sympy.lambdify([sympy.Symbol(n) for n in names],
                        expr.xreplace({s: sympy.Symbol(s.name) for s in expr.free_symbols}),
                        modules=["math", {"FloorDiv": lambda a, b: a // b,
                                          "Mod": lambda a, b: a % b}])
    return lambda sizes: fn(*(sizes[n] for n in names))


def _compile_bool(expr: Any) -> Callable[[dict[str, int]], bool]:
    fn = _compile(expr)
    return lambda sizes: bool(fn(sizes))

