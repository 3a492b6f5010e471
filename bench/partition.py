"""How well autoopt cuts models into pipeline stages, against common baselines and the optimum.

    python bench/partition.py [--threads 1] [--models resnet50,vit_b_16,bert-base,gpt2]
                              [--stages 2,4,8] [--rounds 7] [--write]

Per model (full size, random weights, batch 1; images 224×224, text 128 tokens): capture with
torch.export, profile every node on this CPU, and cut into K stages four ways:

- autoopt: ``passes.partition.partition`` (dynamic program over measured node times, with the
  cost of each stage's input transfer);
- uniform-by-layer: the same number of parametrised ops (convolutions, linears, norms, ...) per
  stage, as pipeline schedules that split "every N layers" do;
- parameter-count: the same parameter bytes per stage (DeepSpeed's ``partition_method=
  "parameters"``);
- optimum: the smallest bottleneck any cut contiguous in the graph's order can have under the
  same costs, found independently of the dynamic program (bisection on the bottleneck with an
  interval-reachability check).

Predicted balance = largest predicted stage time / (total / K). Then every cut's stages are
run in turn on real inputs, interleaved round by round, and timed: measured balance = largest
measured stage / (measured total / K), plus autoopt's worst stage prediction error. Finally, the
time to partition a synthetic 1000-node graph into 8 stages. ``--write`` puts the table into
docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from cost_model_accuracy import MODELS, publish
from torch import nn
from torch.fx import GraphModule

from autoopt.capture.graph import annotate, export_graph, flat_example_inputs
from autoopt.cost_model import CostCache, CostModel, GraphCost, NodeCost
from autoopt.parallel.partition import (
    COMPUTE_OPS,
    DeviceSpec,
    NodeProfile,
    Partition,
    allowed_cuts,
    evaluate,
    partition,
)
from autoopt.parallel.planning import refine_by_measurement
from autoopt.parallel.stages import emit_stages

METHODS = ("autoopt", "uniform-by-layer", "parameter-count")


def quantile_cuts(weights: Sequence[float], k: int, allowed: Sequence[int]) -> tuple[int, ...]:
    """Cuts where the running total of ``weights`` crosses i/k of the whole, each moved to
    the nearest position a stage may start at (keeping the cuts increasing)."""
    prefix = np.concatenate([[0.0], np.cumsum(weights)])
    total = prefix[-1]
    cuts: list[int] = []
    options = np.array(allowed)
    for i in range(1, k):
        want = int(np.searchsorted(prefix, total * i / k))
        later = options[options > (cuts[-1] if cuts else 0)]
        remaining = k - 1 - i  # cuts still to place after this one
        later = later[: len(later) - remaining] if remaining else later
        cuts.append(int(later[np.argmin(np.abs(later - want))]))
    return tuple(cuts)


def baseline_cuts(gm: GraphModule, plan_profile: NodeProfile, k: int) -> dict[str, tuple[int, ...]]:
    allowed = allowed_cuts(gm)
    layers = [1.0 if p > 0 else 0.0 for p in plan_profile.params]
    return {"uniform-by-layer": quantile_cuts(layers, k, allowed),
            "parameter-count": quantile_cuts(list(plan_profile.params), k, allowed)}


def optimum(profile: NodeProfile, k: int, link: float) -> float:
    """The smallest bottleneck over every contiguous cut into k stages (no memory caps),
    by bisection on the bottleneck T: a position is reachable after s stages when a stage
    of time <= T ends there, starting from one reachable after s - 1. For a fixed start i
    the stage time grows with its end, so each start reaches an interval of ends."""
    n = len(profile.order)
    prefix = profile.time_prefix
    transfer = np.where(profile.forbidden, np.inf, profile.crossing / link)

    def feasible(limit: float) -> bool:
        reach = np.zeros(n + 1, dtype=bool)
        reach[0] = True
        for s in range(k):
            starts = np.nonzero(reach[:n])[0]
            budget = limit - (transfer[starts] if s > 0 else 0.0)
            ends = np.searchsorted(prefix, prefix[starts] + budget + 1e-15, side="right") - 1
            ok = ends > starts
            cover = np.zeros(n + 2, dtype=np.int64)
            np.add.at(cover, starts[ok] + 1, 1)
            np.add.at(cover, ends[ok] + 1, -1)
            reach = np.cumsum(cover)[: n + 1] > 0
        return bool(reach[n])

    low, high = 0.0, float(prefix[-1]) + float(np.max(transfer[np.isfinite(transfer)]))
    for _ in range(100):
        middle = (low + high) / 2
        low, high = (low, middle) if feasible(middle) else (middle, high)
    return high


def measure(stage_sets: dict[str, list[GraphModule]], flat: list[Any], rounds: int,
            ) -> dict[str, list[float]]:
    """Median time of every stage of every cut, each cut's stages run in turn on real inputs;
    the cuts interleaved within each round."""
    samples = {name: [[] for _ in stages] for name, stages in stage_sets.items()}
    with torch.no_grad():
        for r in range(rounds + 2):  # two warm-up rounds
            for name, stages in stage_sets.items():
                values = list(flat)
                for i, stage in enumerate(stages):
                    start = time.perf_counter()
                    values = list(stage(*values))
                    if r >= 2:
                        samples[name][i].append(time.perf_counter() - start)
    return {name: [statistics.median(s) for s in per] for name, per in samples.items()}


def run_model(name: str, ks: Sequence[int], rounds: int) -> list[dict[str, Any]]:
    torch.manual_seed(0)
    model, args, kwargs = MODELS[name]()
    with torch.no_grad():
        gm = export_graph(model, args, kwargs)
    gm.graph.eliminate_dead_code()
    gm.recompile()
    flat = list(flat_example_inputs(gm, args, kwargs))
    cost_model = CostModel("cpu", cache=CostCache.in_memory())  # measured in this run
    cost = cost_model.profile(gm, flat)
    link = cost_model.info.ceilings.memory_bandwidth  # a copy between CPU stages
    rows = []
    for k in ks:
        devices = [DeviceSpec("cpu", link_bytes_per_s=link)] * k
        start = time.perf_counter()
        plan = partition(gm, cost, devices)
        seconds = time.perf_counter() - start
        profile = NodeProfile(gm, cost, training=False)
        refined = refine_by_measurement(gm, cost, devices, flat, plan, cost_model)
        plans: dict[str, Partition] = {"autoopt": plan, "autoopt refined": refined}
        for method, cuts in baseline_cuts(gm, profile, k).items():
            plans[method] = evaluate(gm, cost, devices, cuts)
        best = optimum(profile, k, link)
        measured = measure({m: emit_stages(gm, p) for m, p in plans.items()}, flat, rounds)
        row: dict[str, Any] = {"model": name, "k": k, "nodes": len(profile.order),
                               "partition_s": seconds, "optimum": best / plan.ideal_s,
                               "vs_optimum": plan.bottleneck_s / best}
        for method, p in plans.items():
            times = measured[method]
            row[method] = p.balance
            row[method + " measured"] = max(times) / (sum(times) / k)
        row["refined cuts differ"] = refined.cuts != plan.cuts
        predicted, actual = [s.time_s for s in plan.stages], measured["autoopt"]
        row["stage_error"] = max(abs(p - m) / m for p, m in zip(predicted, actual, strict=True))
        # What balance depends on: each stage's share of the total, predicted and measured.
        row["share_error"] = max(abs(p / sum(predicted) - m / sum(actual)) / (m / sum(actual))
                                 for p, m in zip(predicted, actual, strict=True))
        rows.append(row)
        print(f"{name:<10} K={k}  autoopt {plan.balance:.3f} (measured "
              f"{row['autoopt measured']:.3f}, refined {row['autoopt refined measured']:.3f})"
              f"  layers {row['uniform-by-layer']:.3f}  params "
              f"{row['parameter-count']:.3f}  optimum {row['optimum']:.3f}  autoopt/optimum "
              f"{row['vs_optimum']:.4f}  worst stage error {row['stage_error']:.1%} (share "
              f"{row['share_error']:.1%})  "
              f"partition {seconds * 1e3:.0f} ms", flush=True)
    return rows


class _Chain(nn.Module):
    """A 1000-op residual network: groups of elementwise ops with a skip around each."""

    def __init__(self, ops: int = 1000) -> None:
        super().__init__()
        self.ops = ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skip = x
        for i in range(self.ops):
            x = torch.relu(x) if i % 2 else x * 1.01
            if i % 25 == 24:
                x = x + skip
                skip = x
        return x


def large_graph_seconds(k: int = 8, repeats: int = 3) -> tuple[int, float]:
    """Nodes of a synthetic graph and the median seconds to partition it into k stages."""
    gm = torch.fx.symbolic_trace(_Chain(1000))
    annotate(gm, [torch.randn(64, 64)])
    rng = np.random.default_rng(0)
    costs = [NodeCost(n.name, str(n.target), float(rng.uniform(1e-5, 1e-3)), measured=True)
             for n in gm.graph.nodes if n.op in COMPUTE_OPS]
    cost = GraphCost(tuple(costs), sum(c.latency_s for c in costs), 0, 0, 1.0,
                     by_node={c.node: c for c in costs})
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        partition(gm, cost, [DeviceSpec()] * k)
        times.append(time.perf_counter() - start)
    return len(costs), statistics.median(times)


def gpu_rows(microbatches: int = 4, batch: int = 32, repeats: int = 20) -> list[str]:
    """resnet50 as a 2-stage pipeline over the GPUs there are (both stages on cuda:0 with
    one): eager and pipelined call times and the largest difference (bench/gpu_check.py)."""
    import torchvision

    import autoopt

    devices = [f"cuda:{i % torch.cuda.device_count()}" for i in range(2)]
    torch.manual_seed(0)
    model = torchvision.models.resnet50().eval().cuda()
    x = torch.randn(batch, 3, 224, 224, device="cuda")
    pipe = autoopt.optimize(model, (x,), devices=devices, microbatches=microbatches)

    def median_ms(fn: Any) -> float:
        times = []
        with torch.no_grad():
            for i in range(repeats + 3):
                torch.cuda.synchronize()
                start = time.perf_counter()
                fn(x)
                torch.cuda.synchronize()
                if i >= 3:
                    times.append(time.perf_counter() - start)
        return statistics.median(times) * 1e3

    with torch.no_grad():
        error = (pipe(x).cpu() - model(x).cpu()).abs().max().item()
    eager_ms, pipe_ms = median_ms(model), median_ms(pipe)
    return ["## Pipeline on CUDA: resnet50, batch 32", "",
            f"`python bench/gpu_check.py --out OUT` (bench/partition.py gpu_rows): devices "
            f"{devices}, {microbatches} microbatches, compute and copy streams per stage.", "",
            "| eager ms | pipeline ms | predicted balance | max abs error |", "|---|---|---|---|",
            f"| {eager_ms:.2f} | {pipe_ms:.2f} | {pipe.plan.balance:.3f} | {error:.2e} |", "",
            "```", pipe.table(), "```"]


def table(rows: list[dict[str, Any]], threads: int, rounds: int, command: str,
          large: tuple[int, float], load: tuple[float, float]) -> str:
    cpu = CostModel("cpu", cache=CostCache.in_memory()).info.name
    lines = [
        "## Pipeline partitioning (CPU)", "",
        f"Command: `{command}`  ",
        f"Machine: {cpu}, {threads} thread(s), torch {torch.__version__}, Python "
        f"{platform.python_version()}. Batch 1; images 224×224, text 128 tokens; random "
        "weights. Costs: every node profiled on this CPU (autoopt's cost model); links priced "
        "at the measured memory bandwidth (a copy between CPU stages). Load average (1 min) "
        f"{load[0]:.1f} at the start, {load[1]:.1f} at the end (a shared machine: other "
        "processes' work lands in the measured figures).", "",
        "Balance = largest stage time / (total / K); 1.00 is perfect. *Predicted* uses the cost "
        "model's node times (what the partitioner optimises); *measured* runs each cut's stages "
        f"in turn on real inputs, median of {rounds} rounds with the cuts interleaved. "
        "Uniform-by-layer: equal numbers of parametrised ops per stage; parameter-count: equal "
        "parameter bytes per stage (DeepSpeed's `parameters` method); optimum: the least "
        "bottleneck over every cut contiguous in the graph's order, found by an independent "
        "bisection (autoopt's dynamic program is exact over the same set, so autoopt / optimum "
        "checks it). Refined: autoopt's cut corrected by measured stage times "
        "(`pipelining.refine_by_measurement`, 2 rounds, then 3 interleaved trials; what "
        "`optimize(devices=...)` uses). "
        "Stage error: autoopt's worst |predicted − measured| / measured stage time; "
        "share error: the same for each stage's share of the total (what balance depends on).",
        "",
        "| model | nodes | K | autoopt predicted | autoopt measured | autoopt refined, "
        "measured | uniform-by-layer pred. / meas. | parameter-count pred. / meas. | optimum | "
        "autoopt / optimum | worst stage error | worst share error | partition ms |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['nodes']} | {r['k']} | {r['autoopt']:.3f} | "
            f"{r['autoopt measured']:.3f} | {r['autoopt refined measured']:.3f}"
            f"{'' if r['refined cuts differ'] else ' (same cut)'} | {r['uniform-by-layer']:.3f} / "
            f"{r['uniform-by-layer measured']:.3f} | {r['parameter-count']:.3f} / "
            f"{r['parameter-count measured']:.3f} | {r['optimum']:.3f} | "
            f"{r['vs_optimum']:.4f} | {r['stage_error']:.1%} | {r['share_error']:.1%} | "
            f"{r['partition_s'] * 1e3:.0f} |")
    lines += ["", f"Partitioning a synthetic {large[0]}-node residual graph into 8 stages: "
              f"{large[1]:.2f} s (median of 3)."]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--models", default="resnet50,vit_b_16,bert-base,gpt2")
    parser.add_argument("--stages", default="2,4,8")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--write", action="store_true", help="update docs/benchmarks.md")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    ks = [int(k) for k in args.stages.split(",")]
    load = os.getloadavg()[0]
    large = large_graph_seconds()
    print(f"synthetic graph: {large[0]} nodes into 8 stages in {large[1]:.2f} s", flush=True)
    rows = [row for name in args.models.split(",") for row in run_model(name, ks, args.rounds)]
    command = "python bench/partition.py " + " ".join(sys.argv[1:])
    section = table(rows, args.threads, args.rounds, command.strip(), large,
                    (load, os.getloadavg()[0]))
    publish(section, write=args.write)
    return 0


if __name__ == "__main__":
    sys.exit(main())
