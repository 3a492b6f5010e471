"""``autoopt profile``: where a model's time goes on a device, and how well it is predicted."""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from typing import Any

import torch
from torch.utils import _pytree as pytree

from autoopt.capture.graph import export_graph, flat_example_inputs
from autoopt.cost_model import CostModel, GraphCost
from autoopt.errors import DeviceError, ModelError
from autoopt.passes.graph import is_impure


@dataclasses.dataclass(frozen=True)
class ProfileSummary:
    """A model's profile: per-op totals, the whole prediction and the measured time."""

    cost: GraphCost
    measured_s: float
    device: str
    threads: int

    @property
    def error(self) -> float:
        return (self.cost.latency_s - self.measured_s) / self.measured_s


def profile_model(model: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
                  device: str = "cpu", cost: CostModel | None = None) -> ProfileSummary:
    """Capture ``model`` whole with torch.export, time every node, and measure the model."""
    target = torch.device(device)
    if target.type == "cuda" and not torch.cuda.is_available():
        raise DeviceError(f"--device {device} asks for CUDA but no CUDA GPU is available")
    model = model.to(target).eval()
    args, kwargs = pytree.tree_map_only(torch.Tensor, lambda t: t.to(target), (args, kwargs))
    try:
        gm = export_graph(model, args, kwargs)
    except Exception as exc:
        raise ModelError(f"profile needs a whole graph, but torch.export failed: "
                         f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}") from exc
    gm.graph.eliminate_dead_code(is_impure_node=is_impure)  # in-place writes stay
    gm.recompile()
    cost = cost or CostModel(target)
    profile = cost.profile(gm, list(flat_example_inputs(gm, args, kwargs)))
    measured = cost.measure(gm, args, kwargs)
    return ProfileSummary(profile, measured, str(target), torch.get_num_threads())


def format_table(summary: ProfileSummary, top: int = 20) -> str:
    """The most expensive ops (grouped by op), their share, rates and what bounds them."""
    groups: dict[str, list[Any]] = defaultdict(lambda: [0.0, 0, 0, 0, set(), True])
    for c in summary.cost.nodes:
        if c.latency_s <= 0:
            continue
        g = groups[c.op]
        g[0] += c.latency_s
        g[1] += c.flops
        g[2] += c.bytes
        g[3] += 1
        g[4].add(c.bound)
        g[5] = g[5] and c.measured
    total = summary.cost.latency_s
    rows = sorted(groups.items(), key=lambda kv: -kv[1][0])[:top]
    lines = [f"{'op':<44} {'calls':>5} {'time ms':>9} {'share':>6} {'GFLOP/s':>8} "
             f"{'GB/s':>7}  bound"]
    for op, (seconds, flops, nbytes, calls, bounds, measured) in rows:
        bound = "/".join(sorted(bounds))
        mark = "" if measured else " (estimated)"
        lines.append(f"{op[:44]:<44} {calls:>5} {seconds * 1e3:>9.3f} {seconds / total:>6.1%} "
                     f"{flops / seconds / 1e9:>8.1f} {nbytes / seconds / 1e9:>7.2f}  "
                     f"{bound}{mark}")
    lines.append("")
    lines.append(f"device {summary.device}, {summary.threads} thread(s); "
                 f"{sum(c.flops for c in summary.cost.nodes) / 1e9:.2f} GFLOP, "
                 f"peak activations {summary.cost.peak_activation_bytes / 2**20:.1f} MiB, "
                 f"parameters {summary.cost.parameter_bytes / 2**20:.1f} MiB")
    lines.append(f"predicted {total * 1e3:.3f} ms ({summary.cost.measured_fraction:.0%} "
                 f"measured), measured {summary.measured_s * 1e3:.3f} ms, error "
                 f"{summary.error:+.1%}")
    return "\n".join(lines)
