"""Outputs that are plain Python objects holding tensors — transformers' KV caches
(``DynamicCache`` and its layers), a user's dataclass nobody registered — taken apart for
``torch.export`` and rebuilt as the same types.

``torch.export`` flattens a forward's result with torch's pytree, which refuses a type nobody
registered ("Found <class 'DynamicCache'> in output, which is not a known type"), and the
model fell to Dynamo. Registering such types for good would change torch for the whole
process (and ``transformers``' own export helpers register ``DynamicCache`` with other
rules). So the registration lives only while autoopt exports (``as_pytree_nodes``); the graph
module's output spec is then rewritten (``make_portable``) to name autoopt's own node type,
``Rebuilt``, whose unflatten builds an object of the original class. The optimized module
returns a real ``DynamicCache``, and nothing global is left changed after ``optimize``.

An object is taken apart by its attributes (``vars``): the ones that hold a tensor somewhere
become the node's children, in the order ``autoopt.check.inputs`` walks them (a dataclass's fields,
else sorted names), the rest ride along in the spec and are copied into each rebuilt object.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.fx import GraphModule
from torch.fx.graph import _PyTreeCodeGen
from torch.utils import _pytree as pytree

from autoopt.check.inputs import attribute_names

_PLAIN = (bool, int, float, complex, str, bytes, torch.dtype, torch.device, torch.Size)


def foreign_types(value: Any) -> tuple[type, ...]:
    """The types of the objects inside ``value`` that hold tensors but that torch's pytree
    does not know, outermost first (each once)."""
    found: dict[type, None] = {}

    def walk(obj: Any, depth: int) -> None:
        if depth > 8 or obj is None or isinstance(obj, (torch.Tensor, *_PLAIN)):
            return
        kind = type(obj)
        if isinstance(obj, (list, tuple, dict)) or kind in pytree.SUPPORTED_NODES \
                or pytree.is_namedtuple_instance(obj):
            children, _ = pytree.tree_flatten(obj, is_leaf=lambda x: x is not obj)
            for child in children:
                walk(child, depth + 1)
        elif _is_object(obj) and holds_tensor(obj):
            found.setdefault(kind)
            for name in attribute_names(obj):
                walk(getattr(obj, name), depth + 1)

    walk(value, 0)
    return tuple(found)


def holds_tensor(obj: Any, depth: int = 0) -> bool:
    if isinstance(obj, torch.Tensor):
        return True
    if depth > 8 or obj is None or isinstance(obj, _PLAIN):
        return False
    if isinstance(obj, dict):
        return any(holds_tensor(v, depth + 1) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return any(holds_tensor(v, depth + 1) for v in obj)
    if _is_object(obj):
        return any(holds_tensor(getattr(obj, n), depth + 1) for n in attribute_names(obj))
    return False


def _is_object(obj: Any) -> bool:
    """A plain instance whose state is its ``__dict__`` (not a module, class or function)."""
    return (hasattr(obj, "__dict__") and not isinstance(obj, (type, nn.Module))
            and not callable(obj))


def _flatten(obj: Any) -> tuple[list[Any], Any]:
    names = attribute_names(obj)
    children = [n for n in names if holds_tensor(getattr(obj, n))]
    constants = tuple((k, v) for k, v in vars(obj).items() if k not in children)
    return [getattr(obj, n) for n in children], (type(obj), tuple(children), constants)


def _flatten_with_keys(obj: Any) -> tuple[list[tuple[Any, Any]], Any]:
    values, context = _flatten(obj)
    return [(pytree.GetAttrKey(n), v) for n, v in zip(context[1], values, strict=True)], context


def _unflatten(values: Any, context: Any) -> Any:
    kind, children, constants = context
    obj = kind.__new__(kind)
    for name, value in constants:
        try:  # each rebuilt object gets its own copy of a mutable constant
            value = copy.deepcopy(value)
        except Exception:  # noqa: BLE001 - a constant that cannot be copied is shared
            pass
        obj.__dict__[name] = value
    obj.__dict__.update(zip(children, values, strict=True))
    return obj


class Rebuilt:
    """The pytree node type a portable output spec names in place of a scoped type: never
    instantiated; its unflatten builds the original class recorded in the spec's context."""


def _no_instances(obj: Any) -> tuple[list[Any], Any]:
    raise TypeError("Rebuilt only names a node in an output spec")


pytree.register_pytree_node(Rebuilt, _no_instances, _unflatten,
                            serialized_type_name="autoopt.capture.objects.Rebuilt")


@contextlib.contextmanager
def as_pytree_nodes(types: tuple[type, ...]) -> Iterator[tuple[type, ...]]:
    """Register ``types`` with torch's (Python) pytree for the duration of the block and
    yield the ones this registered: types someone registered already keep their own rules
    (and their specs need no rewriting)."""
    added = tuple(t for t in types if t not in pytree.SUPPORTED_NODES)
    for kind in added:
        pytree._private_register_pytree_node(
            kind, _flatten, _unflatten, flatten_with_keys_fn=_flatten_with_keys,
            serialized_type_name=f"autoopt.scoped.{kind.__module__}.{kind.__qualname__}")
    try:
        yield added
    finally:
        for kind in added:
            pytree._deregister_pytree_node(kind)


def scoped_for(value: Any) -> contextlib.AbstractContextManager[tuple[type, ...]]:
    """``as_pytree_nodes`` for the foreign types inside ``value`` (an output of the model)."""
    return as_pytree_nodes(foreign_types(value))


def flatten(value: Any) -> tuple[list[Any], pytree.TreeSpec]:
    """``pytree.tree_flatten(value)`` that takes foreign objects apart too, with a spec that
    rebuilds them without any registration."""
    with scoped_for(value) as scoped:
        leaves, spec = pytree.tree_flatten(value)
    return leaves, portable_spec(spec, scoped)


def portable_spec(spec: pytree.TreeSpec, types: tuple[type, ...]) -> pytree.TreeSpec:
    """``spec`` with every node of a scoped type renamed ``Rebuilt`` (same context)."""
    if spec.is_leaf():
        return spec
    kind = Rebuilt if spec.type in types else spec.type
    return pytree.TreeSpec(kind, spec.context,
                           [portable_spec(c, types) for c in spec.children()])


def make_portable(gm: GraphModule, types: tuple[type, ...]) -> GraphModule:
    """Let ``gm`` build its outputs without the scoped registration of ``types``."""
    codegen = gm.graph._codegen
    if types and isinstance(codegen, _PyTreeCodeGen) and codegen.pytree_info is not None:
        info = codegen.pytree_info
        if info.out_spec is not None:
            codegen.pytree_info = info._replace(out_spec=portable_spec(info.out_spec, types))
            gm.recompile()
    return gm
