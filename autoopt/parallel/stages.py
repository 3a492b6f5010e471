"""Pipeline stages as graph modules: one per stage of a partition, placed on its device.

    x ─ [stage 0 on dev 0] ─ boundary ─ [stage 1 on dev 1] ─ ... ─ y

``emit_stages`` turns a ``Partition`` (``autoopt.parallel.partition``) into one ``GraphModule``
per stage: stage 0 takes the graph's flat inputs, each later stage the values crossing the cut
before it (skip connections passed on by the stages between), the last stage the graph's flat
outputs. Parameters keep their names in the original model (``layer1.0.conv1.weight``). The
local ``Pipeline`` and ``distributed_pipeline`` both run these stages.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import torch
from torch.fx import Graph, GraphModule, Node
from torch.utils import _pytree as pytree

from autoopt.parallel.partition import Partition


def emit_stages(gm: GraphModule, plan: Partition) -> list[GraphModule]:
    """One ``GraphModule`` per stage of ``plan``; calling them in turn, each on the previous
    one's outputs, computes ``gm``'s flat outputs from its flat inputs."""
    nodes = {n.name: n for n in gm.graph.nodes}
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    output = next(n for n in gm.graph.nodes if n.op == "output")
    stages = []
    for s, stage in enumerate(plan.stages):
        graph = Graph()
        env: dict[Node, Node] = {}
        for node in placeholders if s == 0 else [nodes[name] for name in stage.inputs]:
            env[node] = graph.placeholder(node.name)
            env[node].meta = dict(node.meta)

        def load(node: Node, graph: Graph = graph, env: dict[Node, Node] = env) -> Node:
            if node not in env:
                if node.op != "get_attr":
                    raise AssertionError(f"{node.name} is neither computed in nor sent to this "
                                         f"stage")  # the partition's crossing sets say so
                env[node] = graph.get_attr(str(node.target))
                env[node].meta = dict(node.meta)
            return env[node]

        for name in stage.nodes:
            env[nodes[name]] = graph.node_copy(nodes[name], load)
        if s == len(plan.stages) - 1:
            flat = pytree.tree_leaves(output.args[0], is_leaf=lambda x: x is None)
            graph.output(tuple(load(x) if isinstance(x, Node) else x for x in flat))
        else:
            graph.output(tuple(env[nodes[name]] for name in plan.stages[s + 1].inputs))
        graph.lint()
        stages.append(GraphModule(gm, graph, class_name=f"Stage{s}"))
    return stages


def shared_parameters(stages: Sequence[GraphModule]) -> list[tuple[str, tuple[int, ...]]]:
    """Parameters that more than one stage reads (tied weights such as an embedding and the LM
    head), each as (its name in the first stage holding it, the indices of those stages), in
    a deterministic order: every rank derives the same list from the same plan."""
    holders: dict[int, tuple[str, list[int]]] = {}
    for s, stage in enumerate(stages):
        for name, param in stage.named_parameters(remove_duplicate=False):
            entry = holders.setdefault(id(param), (name, []))
            if s not in entry[1]:
                entry[1].append(s)
    return sorted((name, tuple(where)) for name, where in holders.values() if len(where) > 1)


def traced_values(gm: GraphModule, op: str) -> list[Any]:
    """The traced values (``meta["val"]``) of ``gm``'s inputs (``placeholder``) or flat outputs
    (``output``); None where a node has none."""
    if op == "placeholder":
        nodes = [n for n in gm.graph.nodes if n.op == "placeholder"]
    else:
        output = next(n for n in gm.graph.nodes if n.op == "output")
        nodes = pytree.tree_leaves(output.args[0], is_leaf=lambda x: x is None)
    return [n.meta.get("val") if isinstance(n, Node) else n for n in nodes]


def place_stage(stage: GraphModule, device: torch.device) -> GraphModule:
    """The stage with its weights and the tensors it creates on ``device``."""
    tensors = list(stage.parameters()) + list(stage.buffers())
    named = [d for n in stage.graph.nodes for d in pytree.tree_leaves((n.args, n.kwargs))
             if isinstance(d, torch.device)]
    if all(t.device == device for t in tensors) and all(d == device for d in named):
        return stage
    placed = copy.deepcopy(stage).to(device)
    # Ops that create tensors (arange, full, _to_copy) name the capture's device in the graph.
    for node in placed.graph.nodes:
        node.args, node.kwargs = pytree.tree_map_only(torch.device, lambda _: device,
                                                      (node.args, node.kwargs))
    placed.recompile()
    return placed
