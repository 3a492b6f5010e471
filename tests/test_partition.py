"""The pipeline partitioner (passes/partition.py): exact, acyclic, within memory, aware of
device speeds and of the cost of sending activations between stages."""

from __future__ import annotations

import itertools
import random

import networkx as nx
import pytest
import torch
from torch import nn
from torch.fx import GraphModule

from autoopt.capture.graph import export_graph
from autoopt.cost_model import GraphCost, NodeCost
from autoopt.parallel.partition import (
    DeviceSpec,
    PartitionError,
    allowed_cuts,
    evaluate,
    partition,
    stage_graph,
    to_networkx,
)


class InceptionBlock(nn.Module):
    """Three parallel branches concatenated, plus a residual around them."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.b1 = nn.Conv2d(width, width, 1)
        self.b2a = nn.Conv2d(width, width, 1)
        self.b2b = nn.Conv2d(width, width, 3, padding=1)
        self.b3 = nn.Sequential(nn.MaxPool2d(3, 1, 1), nn.Conv2d(width, width, 1))
        self.merge = nn.Conv2d(3 * width, width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        branches = [self.b1(x), self.b2b(torch.relu(self.b2a(x))), self.b3(x)]
        return torch.relu(self.merge(torch.cat(branches, 1)) + x)


class Inception(nn.Module):
    def __init__(self, blocks: int = 3, width: int = 8) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, width, 3, padding=1)
        self.blocks = nn.Sequential(*(InceptionBlock(width) for _ in range(blocks)))
        self.head = nn.Linear(width, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(torch.relu(self.stem(x))).mean((2, 3)))


def mlp(widths: list[int]) -> nn.Module:
    layers: list[nn.Module] = []
    for a, b in itertools.pairwise(widths):
        layers += [nn.Linear(a, b), nn.ReLU()]
    return nn.Sequential(*layers[:-1]).eval()


def captured(model: nn.Module, *inputs: torch.Tensor) -> GraphModule:
    return export_graph(model.eval(), inputs, {})


def costs(gm: GraphModule, times: dict[str, float] | None = None, seed: int = 0) -> GraphCost:
    """A GraphCost with the given (or random) time per compute node."""
    rng = random.Random(seed)
    nodes = []
    for n in gm.graph.nodes:
        if n.op == "call_function":
            t = times[n.name] if times is not None else rng.uniform(1e-4, 1e-3)
            nodes.append(NodeCost(n.name, str(n.target), t, measured=True))
    total = sum(c.latency_s for c in nodes)
    return GraphCost(tuple(nodes), total, 0, 0, 1.0, by_node={c.node: c for c in nodes})


def compute_nodes(gm: GraphModule) -> list[str]:
    return [n.name for n in gm.graph.nodes if n.op == "call_function"]


def brute_force(gm: GraphModule, cost: GraphCost, devices: list[DeviceSpec]) -> float:
    """The smallest bottleneck over every cut into len(devices) contiguous stages."""
    best = float("inf")
    for cuts in itertools.combinations(allowed_cuts(gm), len(devices) - 1):
        plan = evaluate(gm, cost, devices, cuts)
        if all(d.memory_bytes is None or s.memory_bytes <= d.memory_bytes
               for s, d in zip(plan.stages, devices, strict=True)):
            best = min(best, plan.bottleneck_s)
    return best


# --- exactness -------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("k", [2, 3])
def test_dynamic_program_finds_the_brute_force_optimum(seed: int, k: int) -> None:
    gm = captured(Inception(blocks=2), torch.randn(1, 3, 8, 8))
    cost = costs(gm, seed=seed)
    rng = random.Random(seed)
    # Heterogeneous devices with slow links, so transfers and speeds both matter.
    devices = [DeviceSpec("cpu", speed=rng.choice([0.5, 1.0, 2.0]), link_bytes_per_s=2e6)
               for _ in range(k)]
    plan = partition(gm, cost, devices)
    assert plan.bottleneck_s == pytest.approx(brute_force(gm, cost, devices), rel=1e-9)


def test_dynamic_program_is_exact_under_a_memory_cap() -> None:
    gm = captured(mlp([64, 256, 256, 256, 256, 64]), torch.randn(4, 64))
    # Time in the ReLUs, memory in the Linears: balancing time alone crowds the Linears.
    cost = costs(gm, {n: 1e-3 if "relu" in n else 1e-6 for n in compute_nodes(gm)})
    peaks = sorted(max(s.memory_bytes for s in evaluate(gm, cost, [DeviceSpec()] * 3, c).stages)
                   for c in itertools.combinations(allowed_cuts(gm), 2))
    cap = peaks[len(peaks) // 4]  # three quarters of the cuts do not fit
    devices = [DeviceSpec(memory_bytes=cap)] * 3
    plan = partition(gm, cost, devices)
    assert all(s.memory_bytes <= cap for s in plan.stages)
    assert plan.bottleneck_s == pytest.approx(brute_force(gm, cost, devices), rel=1e-9)


# --- structure -------------------------------------------------------------------------------


@pytest.mark.parametrize("k", [2, 4, 7])
def test_stages_are_contiguous_and_acyclic_on_a_branching_graph(k: int) -> None:
    gm = captured(Inception(), torch.randn(1, 3, 8, 8))
    cost = costs(gm)
    plan = partition(gm, cost, [DeviceSpec()] * k)
    order = compute_nodes(gm)
    assert [n for s in plan.stages for n in s.nodes] == order  # every node once, in order
    stages = stage_graph(to_networkx(gm, cost), plan)
    assert nx.is_directed_acyclic_graph(stages)
    assert all(a < b for a, b in stages.edges)  # no stage needs a later stage's output
    # Every value a stage reads from an earlier stage is among its inputs.
    for s in plan.stages[1:]:
        members = set(s.nodes)
        for name in s.nodes:
            node = next(n for n in gm.graph.nodes if n.name == name)
            for arg in node.all_input_nodes:
                if arg.op != "get_attr" and arg.name not in members:
                    assert arg.name in s.inputs


def test_report_gives_times_memory_boundaries_and_balance() -> None:
    gm = captured(mlp([16, 32, 32, 16]), torch.randn(2, 16))
    order = compute_nodes(gm)
    cost = costs(gm, {n: 1e-3 for n in order})
    plan = partition(gm, cost, [DeviceSpec()] * 2)
    assert sum(s.compute_s for s in plan.stages) == pytest.approx(len(order) * 1e-3)
    assert plan.ideal_s == pytest.approx(len(order) * 1e-3 / 2)
    assert plan.balance == pytest.approx(plan.bottleneck_s / plan.ideal_s)
    second = plan.stages[1]
    assert second.inputs and second.input_bytes == 2 * 32 * 4  # one (2, 32) fp32 activation
    assert second.transfer_s == pytest.approx(second.input_bytes / 10e9)
    assert plan.stages[0].parameter_bytes + second.parameter_bytes == sum(
        p.numel() * 4 for p in gm.parameters())
    assert "balance" in plan.table()


def test_networkx_graph_carries_node_and_edge_weights() -> None:
    gm = captured(mlp([16, 32, 8]), torch.randn(2, 16))
    order = compute_nodes(gm)
    cost = costs(gm, {n: 2e-3 for n in order})
    graph = to_networkx(gm, cost, [DeviceSpec("a", speed=2.0, link_bytes_per_s=1e6)])
    first = graph.nodes[order[0]]
    assert first["time_s"] == 2e-3 and first["time_on"]["a"] == 1e-3
    assert first["parameter_bytes"] == (16 * 32 + 32) * 4
    edge = graph.edges[order[0], order[1]]
    assert edge["bytes"] == 2 * 32 * 4 and edge["transfer_s"]["a"] == pytest.approx(256 / 1e6)


# --- what moves the cut -----------------------------------------------------------------------


def test_faster_device_takes_more_of_the_graph() -> None:
    gm = captured(Inception(), torch.randn(1, 3, 8, 8))
    cost = costs(gm, {n: 1e-3 for n in compute_nodes(gm)})
    even = partition(gm, cost, [DeviceSpec(speed=1.0), DeviceSpec(speed=1.0)])
    fast_second = partition(gm, cost, [DeviceSpec(speed=1.0), DeviceSpec(speed=3.0)])
    fast_first = partition(gm, cost, [DeviceSpec(speed=3.0), DeviceSpec(speed=1.0)])
    assert fast_second.cuts[0] < even.cuts[0] < fast_first.cuts[0]
    n = len(compute_nodes(gm))
    assert fast_second.cuts[0] == pytest.approx(n / 4, abs=2)  # a quarter on the slow one
    assert fast_second.ideal_s == pytest.approx(n * 1e-3 / 4)


def test_slow_link_moves_the_cut_to_the_smallest_boundary() -> None:
    # Activations 2048 wide, except one 4-wide bottleneck, off the time-balanced middle.
    gm = captured(mlp([64, 4, 2048, 2048, 2048, 2048, 64]), torch.randn(8, 64))
    cost = costs(gm, {n: 1e-3 for n in compute_nodes(gm)})
    fast = partition(gm, cost, [DeviceSpec(), DeviceSpec(link_bytes_per_s=1e15)])
    slow = partition(gm, cost, [DeviceSpec(), DeviceSpec(link_bytes_per_s=1e6)])
    assert slow.stages[1].input_bytes == 8 * 4 * 4
    assert fast.stages[1].input_bytes > slow.stages[1].input_bytes


def test_memory_caps_are_respected() -> None:
    gm = captured(mlp([64, 1024, 64, 64, 64, 64, 64]), torch.randn(2, 64))
    cost = costs(gm, {n: 1e-3 for n in compute_nodes(gm)})
    free = partition(gm, cost, [DeviceSpec()] * 2)
    cap = max(s.memory_bytes for s in free.stages) - 1  # the time-balanced cut does not fit
    capped = partition(gm, cost, [DeviceSpec(memory_bytes=cap)] * 2)
    assert capped.cuts != free.cuts
    assert all(s.memory_bytes <= cap for s in capped.stages)
    assert capped.bottleneck_s >= free.bottleneck_s


class TiedLM(nn.Module):
    """The embedding's weight is the LM head's: the first node and the last read it."""

    def __init__(self, vocab: int = 256, dim: int = 8) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.body = nn.Sequential(nn.Linear(dim, dim), nn.Tanh(), nn.Linear(dim, dim))
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(self.embed(ids)))


def test_a_weight_read_on_both_sides_of_a_cut_counts_in_both_stages() -> None:
    """Each stage holds its own copy of a tied weight (a process per stage, or a device):
    the memory a cap is checked against counts it in every stage that reads it."""
    gm = captured(TiedLM(), torch.randint(0, 256, (1, 3)))
    tied = 256 * 8 * 4
    total = sum(p.numel() * 4 for p in TiedLM().parameters())  # the tied weight once
    cost = costs(gm)
    for cut in allowed_cuts(gm):
        plan = evaluate(gm, cost, [DeviceSpec()] * 2, [cut])
        assert all(s.parameter_bytes >= tied for s in plan.stages), cut
        assert sum(s.parameter_bytes for s in plan.stages) == total + tied
    whole = evaluate(gm, cost, [DeviceSpec()], [])
    assert whole.stages[0].parameter_bytes == total


def test_training_counts_every_microbatch_in_flight() -> None:
    gm = captured(mlp([16, 64, 64, 16]), torch.randn(4, 16))
    cost = costs(gm, seed=3)
    one = partition(gm, cost, [DeviceSpec()] * 2, microbatches=1, training=True)
    eight = evaluate(gm, cost, [DeviceSpec()] * 2, one.cuts, microbatches=8, training=True)
    for a, b in zip(one.stages, eight.stages, strict=True):
        assert b.activation_bytes > a.activation_bytes


# --- errors ------------------------------------------------------------------------------------


def test_zero_stages_is_an_error() -> None:
    gm = captured(mlp([4, 4]), torch.randn(1, 4))
    with pytest.raises(PartitionError, match="stages must be at least 1"):
        partition(gm, costs(gm), [])


def test_more_stages_than_nodes_is_an_error() -> None:
    gm = captured(mlp([4, 4, 4]), torch.randn(1, 4))
    n = len(compute_nodes(gm))
    with pytest.raises(PartitionError, match=f"{n} compute nodes into {n + 1} stages.*at most "
                                             f"{n} stages"):
        partition(gm, costs(gm), [DeviceSpec()] * (n + 1))


def test_a_graph_without_compute_nodes_is_an_error_that_says_so() -> None:
    gm = captured(nn.Identity(), torch.randn(1, 4))
    assert compute_nodes(gm) == []
    with pytest.raises(PartitionError, match=r"the graph has no compute nodes \(its outputs are "
                                             r"its inputs or constants\).*into 2 stages"):
        partition(gm, costs(gm), [DeviceSpec()] * 2)


def test_a_node_bigger_than_every_device_is_an_error() -> None:
    gm = captured(mlp([256, 256, 8]), torch.randn(1, 256))
    with pytest.raises(PartitionError, match=r"node linear .* alone needs 0\.3 MiB.*largest "
                                             r"device memory, 0\.1 MiB"):
        partition(gm, costs(gm), [DeviceSpec(memory_bytes=2**17)] * 2)


def test_caps_no_cut_can_meet_are_an_error() -> None:
    gm = captured(mlp([64, 256, 256, 64]), torch.randn(1, 64))
    biggest = (256 * 256 + 256) * 4 + 4 * 1024
    with pytest.raises(PartitionError, match="no cut into 2 stages fits the devices' memory"):
        partition(gm, costs(gm), [DeviceSpec(memory_bytes=biggest)] * 2)


def test_cuts_that_do_not_make_the_stages_are_an_error() -> None:
    gm = captured(mlp([4, 4, 4]), torch.randn(1, 4))
    with pytest.raises(PartitionError, match=r"cuts \[2, 1\] do not make 3 non-empty stages"):
        evaluate(gm, costs(gm), [DeviceSpec()] * 3, (2, 1))
