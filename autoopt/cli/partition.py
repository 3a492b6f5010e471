"""``autoopt partition``: cut a model into pipeline stages balanced by measured time; print
the stage table (and plot it)."""

from __future__ import annotations

import argparse

from autoopt.cli.common import add_model_arguments, check_output, load_workload, parse_size
from autoopt.cli.progress import output, stage
from autoopt.errors import ConfigError, require


def add_parser(sub: argparse._SubParsersAction) -> None:
    part = sub.add_parser("partition", help="cut a model into pipeline stages balanced by "
                                            "measured time; print the stage table")
    add_model_arguments(part, device="none")
    part.add_argument("--stages", type=int, required=True, help="pipeline stages (K)")
    part.add_argument("--devices", default=None, help="comma-separated, one per stage "
                      "(default: cpu for each)")
    part.add_argument("--memory", default=None, metavar="SIZE",
                      help="each device's memory, e.g. 16GiB")
    part.add_argument("--microbatches", type=int, default=1, help="microbatches in flight")
    part.add_argument("--plot", metavar="PATH.png", help="a per-stage time/memory bar chart "
                      "(needs matplotlib)")


def run(args: argparse.Namespace) -> int:
    import torch
    from torch.utils import _pytree as pytree

    from autoopt.capture.graph import export_graph
    from autoopt.cost_model import CostModel
    from autoopt.parallel.planning import device_specs, measured_device_specs, plan_stages
    from autoopt.parallel.plot import plot_stages

    check_output(args.plot, "--plot")
    devices = args.devices.split(",") if args.devices else ["cpu"] * args.stages
    if len(devices) != args.stages:
        raise ConfigError(f"--devices lists {len(devices)} device(s) for --stages "
                          f"{args.stages}; list one per stage.")
    memory = parse_size("--memory", args.memory) if args.memory else None
    if args.plot:
        require("matplotlib", "--plot", "pip install matplotlib")
    model, inputs, kwargs = load_workload(args, train=False)
    stage("capturing the graph")
    with torch.no_grad():
        gm = export_graph(model, inputs, kwargs)
    flat = pytree.tree_leaves((inputs, kwargs))
    cost_model = CostModel("cpu")
    present = all(torch.device(d).type == "cpu" or (torch.device(d).index or 0)
                  < torch.cuda.device_count() for d in devices)
    stage("measuring the ops and the devices; choosing the cuts")
    if present:
        specs = measured_device_specs(devices, cost_model, memory)
    else:  # planning for devices elsewhere: priced as this CPU
        specs = device_specs(devices, memory)
        output("note: not every device is on this machine; stages are priced as on this CPU")
    plan = plan_stages(gm, flat, specs, cost_model=cost_model, microbatches=args.microbatches)
    output(plan.table())
    if args.plot:
        plot_stages(plan, args.plot)
        output(f"wrote {args.plot}")
    return 0
