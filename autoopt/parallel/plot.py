"""The ``autoopt partition --plot`` chart: each stage's predicted time and memory."""

from __future__ import annotations

from autoopt.errors import ConfigError
from autoopt.parallel.partition import Partition


def _require_matplotlib() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError as exc:
        raise ConfigError("--plot needs matplotlib, which is not installed: "
                          "pip install matplotlib (or leave out --plot)") from exc


def plot_stages(plan: Partition, path: str) -> None:
    """A bar chart per stage: predicted time (compute and transfer) and memory."""
    _require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")  # files only; no display needed
    import matplotlib.pyplot as plt

    index = [s.index for s in plan.stages]
    fig, (times, memory) = plt.subplots(1, 2, figsize=(10, 4))
    compute = [s.compute_s * 1e3 for s in plan.stages]
    times.bar(index, compute, label="compute")
    times.bar(index, [s.transfer_s * 1e3 for s in plan.stages], bottom=compute,
              label="input transfer")
    times.axhline(plan.ideal_s * 1e3, color="gray", linestyle="--", label="ideal")
    times.set(xlabel="stage", ylabel="ms per microbatch",
              title=f"time (balance {plan.balance:.2f})")
    times.legend()
    params = [s.parameter_bytes / 2**20 for s in plan.stages]
    memory.bar(index, params, label="parameters")
    memory.bar(index, [s.activation_bytes / 2**20 for s in plan.stages], bottom=params,
               label="activations")
    memory.set(xlabel="stage", ylabel="MiB", title="memory")
    for axes in (times, memory):
        axes.set_xticks(index)
    memory.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
