"""``autoopt profile``: time every op of a model on a device; print the costliest and the
predicted against the measured latency."""

from __future__ import annotations

import argparse
import dataclasses
import json

from autoopt.cli.common import add_model_arguments, check_output, load_workload
from autoopt.cli.progress import output, stage


def add_parser(sub: argparse._SubParsersAction) -> None:
    prof = sub.add_parser("profile", help="time every op of a model on a device; show the top")
    add_model_arguments(prof, device="cpu")
    prof.add_argument("--top", type=int, default=20, help="rows in the table")
    prof.add_argument("--json", metavar="PATH", help="write every node's cost as JSON")


def run(args: argparse.Namespace) -> int:
    from autoopt.diagnose.profiling import format_table, profile_model

    check_output(args.json, "--json")
    model, inputs, kwargs = load_workload(args)
    stage(f"capturing and timing every op on {args.device}")
    summary = profile_model(model, inputs, kwargs, args.device)
    output(format_table(summary, args.top))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": summary.device, "threads": summary.threads,
                       "predicted_s": summary.cost.latency_s, "measured_s": summary.measured_s,
                       "nodes": [dataclasses.asdict(c) for c in summary.cost.nodes]}, f, indent=1)
    return 0
