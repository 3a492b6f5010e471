"""The memory planner: saved activations per segment, the exact plan, the greedy fallback, the
budget option and its errors."""

from __future__ import annotations

import itertools
import random

import pytest
import torch
from torch import nn

import autoopt
from autoopt.capture.graph import export_graph
from autoopt.options.memory import budget_bytes, parse_budget
from autoopt.planning.activations import profile_activations
from autoopt.planning.memory_plan import BudgetTooSmall, MemoryPlan, plan_memory
from autoopt.planning.segments import (
    KEEP,
    MODES,
    OFFLOAD,
    RECOMPUTE,
    Segment,
    added_seconds,
    peak_bytes,
)

BANDWIDTH = 1e6  # bytes/s: offloading 1000 bytes costs 2 ms without overlap


def _segments(specs: list[tuple[int, int, float]]) -> list[Segment]:
    """(saved bytes, input bytes, forward seconds) per segment."""
    return [Segment(i, (f"n{i}",), ((2 * i, s),), ((2 * i + 1, inp),), t)
            for i, (s, inp, t) in enumerate(specs)]


def _brute_force(segments: list[Segment], budget: int, modes: tuple[str, ...]) -> float:
    costs = [sum(added_seconds(segments, chosen, BANDWIDTH, False))
             for chosen in itertools.product(modes, repeat=len(segments))
             if peak_bytes(segments, chosen) <= budget]
    return min(costs, default=float("inf"))


# --- the cost of a plan ---------------------------------------------------------------------


def test_peak_counts_kept_inputs_of_recomputed_and_prefetched_segments() -> None:
    segs = _segments([(100, 10, 1.0), (200, 20, 1.0), (300, 30, 1.0)])
    assert peak_bytes(segs, [KEEP] * 3) == 600
    # Recompute the middle: 100 + 20 kept after forward; its backward regenerates 200.
    assert peak_bytes(segs, [KEEP, RECOMPUTE, KEEP]) == max(100 + 20 + 300, 100 + 200 + 20)
    # Offload the first: segment 1's backward runs while segment 0 comes back.
    assert peak_bytes(segs, [OFFLOAD, KEEP, KEEP]) == 500
    assert peak_bytes(segs, [OFFLOAD, OFFLOAD, OFFLOAD]) == 300 + 200


def test_added_time_is_forward_for_recompute_and_unhidden_copies_for_offload() -> None:
    segs = _segments([(1000, 0, 0.5e-3), (1000, 0, 0.5e-3)])
    assert added_seconds(segs, [RECOMPUTE, KEEP], BANDWIDTH, False) == [0.5e-3, 0.0]
    assert added_seconds(segs, [OFFLOAD, KEEP], BANDWIDTH, False) == [2e-3, 0.0]
    # With overlap: 1 ms out hides 0.5 ms behind segment 1's forward, 1 ms back all of it.
    overlapped = added_seconds(segs, [OFFLOAD, KEEP], BANDWIDTH, True)
    assert overlapped[0] == pytest.approx(0.5e-3)


# --- planning ---------------------------------------------------------------------------------


def test_budget_that_fits_keeps_everything() -> None:
    segs = _segments([(100, 10, 1.0), (100, 10, 1.0)])
    plan = plan_memory(segs, 200, link_bandwidth=BANDWIDTH)
    assert plan.modes == (KEEP, KEEP) and plan.method == "keep-all"
    assert plan.added_seconds == 0.0


def test_recomputes_the_cheapest_bytes() -> None:
    # Same bytes; segment 1 is the cheapest to recompute, so it is the one chosen.
    segs = _segments([(800, 8, 3e-3), (800, 8, 1e-3), (800, 8, 2e-3), (800, 8, 3e-3)])
    plan = plan_memory(segs, 2500, modes=(KEEP, RECOMPUTE))
    assert plan.modes == (KEEP, RECOMPUTE, KEEP, KEEP)
    assert plan.peak_bytes <= plan.budget


@pytest.mark.parametrize("seed", range(6))
def test_exact_plan_matches_brute_force(seed: int) -> None:
    rng = random.Random(seed)
    # Multiples of budget / 4096 bytes, so the planner's rounding is exact.
    budget = 4096 * 8
    segs = _segments([(8 * rng.randint(100, 900), 8 * rng.randint(10, 300),
                       rng.uniform(1e-4, 5e-3)) for _ in range(6)])
    need = peak_bytes(segs, [KEEP] * 6)
    scale = budget / (need * rng.uniform(0.35, 0.8))  # a budget of 35-80% of the need
    segs = _segments([(8 * round(s.saved_bytes * scale / 8), 8 * round(s.input_bytes * scale / 8),
                       s.forward_s) for s in segs])
    best = _brute_force(segs, budget, MODES)
    try:
        plan = plan_memory(segs, budget, link_bandwidth=BANDWIDTH)
    except BudgetTooSmall:
        assert best == float("inf")
        return
    assert plan.method == "dp"
    assert plan.peak_bytes <= budget
    assert plan.added_seconds == pytest.approx(best)


def test_greedy_fallback_when_the_exact_search_has_no_time() -> None:
    segs = _segments([(1000, 50, 1e-3 * (i + 1)) for i in range(8)])
    plan = plan_memory(segs, 4000, link_bandwidth=BANDWIDTH, time_limit_s=0.0)
    assert plan.method == "greedy"
    assert plan.peak_bytes <= 4000
    exact = plan_memory(segs, 4000, link_bandwidth=BANDWIDTH)
    assert exact.added_seconds <= plan.added_seconds + 1e-12


def test_infeasible_budget_names_the_smallest_that_fits() -> None:
    segs = _segments([(1000, 400, 1e-3), (1000, 400, 1e-3), (1000, 400, 1e-3)])
    with pytest.raises(BudgetTooSmall, match=r"smallest budget a plan meets is") as info:
        plan_memory(segs, 500, modes=(KEEP, RECOMPUTE))
    smallest = info.value.smallest
    assert 500 < smallest < 3000
    assert plan_memory(segs, smallest, modes=(KEEP, RECOMPUTE)).peak_bytes <= smallest
    with pytest.raises(BudgetTooSmall):
        plan_memory(segs, int(smallest * 0.97), modes=(KEEP, RECOMPUTE))


def test_modes_are_reported_as_asked() -> None:
    segs = _segments([(1000, 400, 1e-3), (1000, 400, 1e-3), (1000, 400, 1e-3)])
    with pytest.raises(BudgetTooSmall, match=r"no plan with modes recompute \(and keep, always "
                                             r"allowed\) keeps"):
        plan_memory(segs, 500, modes=(RECOMPUTE,))
    plan = plan_memory(segs, 2500, modes=(RECOMPUTE,))
    assert plan.requested == (RECOMPUTE,) and plan.available == (KEEP, RECOMPUTE)
    assert "modes: recompute (and keep, always allowed)" in plan.describe()
    # Offload needs a device-host link; asked for without one, the plan says it was left out.
    plan = plan_memory(segs, 2500, modes=(KEEP, OFFLOAD, RECOMPUTE))
    assert OFFLOAD not in plan.modes
    assert "modes: keep/offload/recompute; offload not available here" in plan.describe()


def test_plan_in_plain_words() -> None:
    segs = _segments([(2 * 2**20, 2**10, 1e-3), (3 * 2**20, 2**10, 2e-3)])
    plan = MemoryPlan(tuple(segs), (RECOMPUTE, OFFLOAD), 6 * 2**20, BANDWIDTH)
    text = plan.describe()
    assert "budget 6.0 MiB" in text and "without a plan 5.0 MiB" in text
    assert "segment  0" in text and "recompute in backward" in text
    assert "segment  1" in text and "offload to host" in text
    assert "1 offloaded, 0 recomputed selectively, 1 recomputed" in text


# --- saved activations from a real graph --------------------------------------------------------


def test_saved_activations_listed_per_node_with_sizes() -> None:
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 8)).train()
    x = torch.randn(4, 16)
    gm = export_graph(model, (x,), {})
    profile = profile_activations(gm, (x,))
    segments, activations = profile.segments(2)
    # linear saves its input (4x16 floats); relu its result (4x64); the last linear its input,
    # which is relu's result, the same storage.
    assert profile.saved_bytes == 4 * 16 * 4 + 4 * 64 * 4
    assert {a.nbytes for a in activations} == {4 * 16 * 4, 4 * 64 * 4}
    assert all(a.segment in (0, 1) for a in activations)
    assert {(a.saved_by, a.producer) for a in activations} == {
        ("linear", "input_1"), ("relu", "relu"), ("linear_1", "relu")}
    plan = MemoryPlan(tuple(segments), (KEEP, RECOMPUTE), 10**6, BANDWIDTH,
                      activations=tuple(activations))
    assert "saved by relu" in plan.describe_activations()
    assert [n for s in segments for n in s.nodes] == [n.name for n in profile.order]
    assert sum(s.saved_bytes for s in segments) >= profile.saved_bytes


# --- the option -------------------------------------------------------------------------------


@pytest.mark.parametrize("text, expected", [("8GiB", 8 * 2**30), ("512MiB", 512 * 2**20),
                                             ("1.5GB", 1_500_000_000), ("4096", 4096),
                                             (1000, 1000), (0.5, 0.5)])
def test_budget_forms(text: object, expected: float) -> None:
    assert parse_budget(text) == expected


@pytest.mark.parametrize("value, message", [
    (0, "which is not positive"), (-5, "which is not positive"), ("0MiB", "not positive"),
    (1.5, "outside (0, 1]"), ("lots", "cannot read 'lots'"), ("8 parsecs", "cannot read"),
    (True, "got True"), ([1], "got list"),
])
def test_bad_budget_is_a_config_error(value: object, message: str) -> None:
    with pytest.raises(autoopt.ConfigError, match="memory_budget is bytes") as info:
        autoopt.OptimizeConfig(memory_budget=value)
    assert message in str(info.value)


def test_fraction_is_of_device_memory() -> None:
    assert budget_bytes(parse_budget(0.25), 8 * 2**30) == 2 * 2**30
    assert budget_bytes(parse_budget("1GiB"), 8 * 2**30) == 2**30


def test_bad_modes_are_a_config_error() -> None:
    with pytest.raises(autoopt.ConfigError, match=r"memory_modes must be drawn from"):
        autoopt.OptimizeConfig(memory_modes=("keep", "swap"))


def test_budget_without_training_is_a_config_error() -> None:
    model = nn.Linear(4, 4).eval()
    with pytest.raises(autoopt.ConfigError, match="pass training=True"):
        autoopt.optimize(model, (torch.randn(2, 4),), memory_budget="1MiB")


def test_budget_on_a_partial_capture_raises() -> None:
    # A budget the module would ignore is an error, not a warning (no feature silently
    # dropped); the message names the capture method and why no whole graph was taken.
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)).train()
    model[1].register_forward_hook(lambda m, i, o: None)  # only Dynamo keeps hooks
    with pytest.raises(autoopt.ConfigError, match=r"captured by dynamo.*no memory plan "
                                                 r"applies.*hooks"):
        autoopt.optimize(model, (torch.randn(3, 4),), training=True, memory_budget="1MiB")
    fast = autoopt.optimize(model, (torch.randn(3, 4),), training=True)  # without: trains
    assert fast.report.capture_method == "dynamo"


def test_report_shows_the_plan() -> None:
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(),
                          nn.Linear(64, 4)).train()
    fast = autoopt.optimize(model, (torch.randn(32, 16),), training=True,
                            memory_budget=13_000)
    plan = fast.report.captures[0].memory_plan
    assert plan is not None and plan.count(RECOMPUTE) > 0 and plan.peak_bytes <= 13_000
    text = str(fast.report)
    assert "memory plan (" in text and "recompute in backward" in text
    assert "modes: keep/selective/recompute" in text and "the default on this device" in text


def test_report_names_the_modes_asked() -> None:
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(),
                          nn.Linear(64, 4)).train()
    fast = autoopt.optimize(model, (torch.randn(32, 16),), training=True,
                            memory_budget=13_000, memory_modes=("recompute",))
    assert "modes: recompute (and keep, always allowed)" in str(fast.report)
    with pytest.raises(autoopt.ConfigError, match=r"no plan with modes recompute \(and keep"):
        autoopt.optimize(model, (torch.randn(32, 16),), training=True, memory_budget=100,
                         memory_modes=("recompute",))


def test_a_plan_that_changes_the_function_is_an_error_not_a_silent_fallback(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The memory plan is a checked step of the driver: a plan that fails verification used to
    read as "captured graph differs from eager" and the capture fell through to Dynamo, where
    no plan applies, so the budget the user asked for was dropped."""
    import autoopt.compile.specialize as specialize
    from autoopt.passes.graph import copy_graph_module

    real = specialize.budget_lib.apply_memory_budget

    def broken(gm, ctx, budget, modes=None):  # type: ignore[no-untyped-def]
        planned, plan = real(gm, ctx, budget, modes)
        planned = copy_graph_module(planned)  # the plan may keep gm itself: leave gm intact
        output = next(n for n in planned.graph.nodes if n.op == "output")
        (result,) = output.args[0] if isinstance(output.args[0], (tuple, list)) else (
            output.args[0],)
        with planned.graph.inserting_before(output):
            doubled = planned.graph.call_function(torch.mul, (result, 2.0))
        output.replace_input_with(result, doubled)
        planned.recompile()
        return planned, plan

    monkeypatch.setattr(specialize.budget_lib, "apply_memory_budget", broken)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4)).train()
    with pytest.raises(autoopt.ConfigError, match="memory plan changes what the model computes"):
        autoopt.optimize(model, (torch.randn(4, 8),), memory_budget="1MiB")
