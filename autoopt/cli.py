"""The ``autoopt`` command line."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

import torch

from .errors import AutoOptError


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="autoopt", description="Optimize PyTorch models.")
    sub = parser.add_subparsers(dest="command", required=True)
    opt = sub.add_parser("optimize", help="capture, optimize and verify a model; print a report")
    opt.add_argument("model", help="package.module:factory, path/to/file.py:Name, or model.pt2")
    opt.add_argument("--input", action="append", required=True, metavar="[NAME=]SHAPE[:DTYPE]",
                     help="an example input, e.g. 1x3x224x224 or input_ids=1x128:int64; repeat "
                          "for several inputs")
    opt.add_argument("--dtype", default="float32", help="dtype of inputs that name none")
    opt.add_argument("--int-high", type=int, default=100,
                     help="integer inputs are drawn from [0, INT_HIGH) (token ids)")
    opt.add_argument("--device", default=None, help="cpu, cuda, cuda:N (default: the model's)")
    opt.add_argument("--train", action="store_true", help="keep the model in train mode "
                     "(default: eval)")
    opt.add_argument("--dynamic", action="store_true", help="let input dimensions vary")
    opt.add_argument("--disable", action="append", default=[], metavar="PASS",
                     help="leave a pass out (repeatable)")
    opt.add_argument("--no-verify", action="store_true", help="skip checking against eager")
    opt.add_argument("--save", metavar="PATH.pt2",
                     help="save the optimized graph as a torch.export program")
    opt.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    opt.add_argument("-v", "--verbose", action="store_true")

    prof = sub.add_parser("profile", help="time every op of a model on a device; show the top")
    prof.add_argument("model", help="package.module:factory, path/to/file.py:Name, or model.pt2")
    prof.add_argument("--input", action="append", required=True, metavar="[NAME=]SHAPE[:DTYPE]")
    prof.add_argument("--dtype", default="float32", help="dtype of inputs that name none")
    prof.add_argument("--int-high", type=int, default=100)
    prof.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N")
    prof.add_argument("--top", type=int, default=20, help="rows in the table")
    prof.add_argument("--json", metavar="PATH", help="write every node's cost as JSON")
    prof.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    prof.add_argument("-v", "--verbose", action="store_true")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        if args.command == "optimize":
            return _optimize(args)
        if args.command == "profile":
            from .profiling import profile_command

            return profile_command(args)
    except AutoOptError as exc:
        print(f"autoopt: error: {exc}", file=sys.stderr)
        return 2
    return 1


def _optimize(args: argparse.Namespace) -> int:
    from .api import optimize
    from .emit import save_program
    from .loading import load_model, model_inputs

    if args.threads:
        torch.set_num_threads(args.threads)
    model = load_model(args.model)
    if not args.model.endswith(".pt2"):  # an exported program has its mode baked in
        model.train(args.train)
    inputs, kwargs = model_inputs(args.input, args.dtype, args.int_high)
    optimized = optimize(model, inputs, kwargs, device=args.device, dynamic=args.dynamic,
                         disable=tuple(args.disable), verify=not args.no_verify)
    print(optimized.report)
    if args.save:
        save_program(optimized, inputs, kwargs, args.save)
        print(f"saved {args.save}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
