"""``autoopt report``: optimize, diagnose and time a model; write one self-contained HTML
report with charts."""

from __future__ import annotations

import argparse

from autoopt.cli.common import add_disable_argument, check_output, disabled, load_workload
from autoopt.cli.diagnose import add_workload_arguments
from autoopt.cli.progress import output
from autoopt.errors import InputError


def add_parser(sub: argparse._SubParsersAction) -> None:
    rep = sub.add_parser("report", help="optimize, diagnose and time a model; write one "
                                        "self-contained HTML report with charts")
    add_workload_arguments(rep)
    rep.add_argument("-o", "--output", required=True, metavar="PATH.html")
    rep.add_argument("--title", default=None, help="the report's heading (default: MODEL)")
    add_disable_argument(rep)


def run(args: argparse.Namespace) -> int:
    import torch
    from torch.utils import _pytree as pytree

    from autoopt.diagnose.collect import collect
    from autoopt.diagnose.render import write_report
    from autoopt.diagnose.workload import console_progress

    check_output(args.output, "-o")
    if not args.input:
        raise InputError("autoopt report needs --input SHAPE (repeatable), e.g. "
                         "--input 1x3x224x224")
    model, inputs, kwargs = load_workload(args, train=args.training)
    if args.device:
        device = torch.device(args.device)
        inputs, kwargs = pytree.tree_map_only(torch.Tensor, lambda t: t.to(device),
                                              (inputs, kwargs))
    data = collect(model, inputs, kwargs, training=args.training, steps=args.steps,
                   title=args.title or args.model, progress=console_progress,
                   disable=disabled(args), device=args.device)
    path = write_report(args.output, data)
    output(f"wrote {path} ({path.stat().st_size / 1024:.0f} KiB)")
    for name, seconds in data.latency_s.items():
        output(f"{name}: {seconds * 1e3:.3f} ms")
    if data.before is not None and data.before.top is not None:
        output(f"top cause: {data.before.top.cause} ({data.before.top.share:.0%} of step time)")
    return 0
