"""Small graph helpers every pass needs: arguments by name, node metadata, attributes, new
constants. One place, so passes read alike and a fix lands everywhere."""

from __future__ import annotations

from typing import Any

import torch
from torch.fx import GraphModule, Node
from torch.fx.operator_schemas import normalize_function


def call_kwargs(node: Node) -> dict[str, Any] | None:
    """The call's arguments by parameter name (``self`` is named ``input``); None when the
    target's signature cannot be matched."""
    try:
        pair = normalize_function(node.target, node.args, node.kwargs,
                                  normalize_to_only_use_kwargs=True)
    except Exception:  # noqa: BLE001 - an unmatchable signature simply means "no match"
        return None
    return dict(pair.kwargs) if pair is not None else None


def meta_val(node: Any) -> Any:
    """The node's example value (``meta["val"]``, or Dynamo's ``example_value``)."""
    if not isinstance(node, Node):
        return None
    return node.meta.get("val", node.meta.get("example_value"))


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
    gm.register_buffer(name, value)
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
