"""``autoopt diagnose``: run a workload; say why the device is idle and which option fixes it."""

from __future__ import annotations

import argparse
from typing import Any

from autoopt.cli.common import add_model_arguments, load_workload
from autoopt.cli.progress import output
from autoopt.errors import InputError


def add_workload_arguments(parser: argparse.ArgumentParser) -> None:
    """The options ``diagnose`` and ``report`` share."""
    add_model_arguments(parser, inputs_required=False, device=None,
                        device_help="cpu, cuda, cuda:N (default: the model's device)")
    parser.add_argument("--training", "--train", dest="training", action="store_true",
                        help="forward and backward steps")
    parser.add_argument("--steps", type=int, default=10, help="timed steps")


def add_parser(sub: argparse._SubParsersAction) -> None:
    diag = sub.add_parser("diagnose", help="run a workload; say why the device is idle and "
                                           "which option fixes it")
    add_workload_arguments(diag)
    diag.add_argument("--loader", metavar="FILE.py:NAME", help="batches from a DataLoader "
                      "(or a function returning one) instead of --input")
    diag.add_argument("--interval", type=float, default=0.05, help="seconds between "
                      "utilization samples")
    diag.add_argument("--apply", action="store_true", help="optimize with the fixes found; "
                      "show before/after")


def run(args: argparse.Namespace) -> int:
    from autoopt.diagnose.diagnosis import diagnose
    from autoopt.diagnose.workload import console_progress, load_batches

    if not args.input and not args.loader:
        raise InputError("autoopt diagnose needs --input SHAPE (repeatable) or --loader "
                         "file.py:make_loader")
    model, inputs, kwargs = load_workload(args)
    data: Any = inputs
    if args.loader:
        data, kwargs = load_batches(args.loader), {}
    diagnosis = diagnose(model, data, kwargs or None, training=args.training, steps=args.steps,
                         device=args.device, interval_s=args.interval,
                         progress=console_progress)
    output(str(diagnosis))
    if args.apply:
        output()
        output(str(diagnosis.apply(progress=console_progress)))
    return 0
