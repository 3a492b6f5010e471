"""Contiguous groups of a graph's nodes: ``balanced_cut`` into groups of near-equal predicted
time (``bench/cost_model_accuracy.py`` checks stage predictions against measured stages with
it) and ``split_stages`` into one submodule per group (the recompute runtime wraps each
segment of a memory plan this way). The pipeline partitioner's exact cut is
``autoopt.parallel.partition``."""

from __future__ import annotations

from collections.abc import Sequence

from torch.fx import GraphModule, Node
from torch.fx.passes.split_module import split_module

from .model import GraphCost


def balanced_cut(order: Sequence[Node], cost: GraphCost, k: int) -> list[list[Node]]:
    """Split ``order`` (compute nodes in execution order) into ``k`` contiguous groups of
    near-equal predicted time, by cutting at the running total's multiples of ``total/k``."""
    times = [cost.by_node[n.name].latency_s if n.name in cost.by_node else 0.0 for n in order]
    total = sum(times)
    groups: list[list[Node]] = [[] for _ in range(k)]
    running = 0.0
    for node, t in zip(order, times, strict=True):
        index = min(k - 1, int((running + t / 2) / total * k)) if total else 0
        groups[index].append(node)
        running += t
    return [g for g in groups if g]


def split_stages(gm: GraphModule, groups: Sequence[Sequence[Node]]) -> GraphModule:
    """A module whose submodules ``submod_0..`` are the stages, called in order."""
    stage_of = {n: i for i, group in enumerate(groups) for n in group}
    last = 0
    # Nodes outside the groups (placeholders, attributes, outputs) follow their first user.
    for node in gm.graph.nodes:
        if node in stage_of:
            last = stage_of[node]
        elif node.op not in ("placeholder", "output"):
            users = [stage_of[u] for u in node.users if u in stage_of]
            stage_of[node] = min(users) if users else last
    return split_module(gm, gm, lambda n: stage_of.get(n, last), keep_original_order=True)
