"""``autoopt optimize``: capture, optimize and verify a model; print the report."""

from __future__ import annotations

import argparse

from autoopt.cli.common import (
    add_disable_argument,
    add_dynamic_argument,
    add_model_arguments,
    check_output,
    disabled,
    load_workload,
    named_dynamic_shapes,
    parse_budget_option,
)
from autoopt.cli.names import PRECISIONS
from autoopt.cli.progress import output, stage
from autoopt.errors import ConfigError
from autoopt.options.backends import BACKENDS


def add_parser(sub: argparse._SubParsersAction) -> None:
    opt = sub.add_parser("optimize", help="capture, optimize and verify a model; print a report")
    add_model_arguments(opt, device=None,
                        device_help="cpu, cuda, cuda:N (default: the model's device)")
    opt.add_argument("--train", "--training", dest="train", action="store_true",
                     help="keep the model in train mode and optimize for training (default: "
                          "eval, inference)")
    add_dynamic_argument(opt)
    add_disable_argument(opt)
    opt.add_argument("--precision", choices=PRECISIONS, default=None,
                     help="compute in lower precision where the end-to-end error stays within "
                          "the tolerance (int8: CPU inference only; default: fp32)")
    opt.add_argument("--calibration", default=None, metavar="DIR_OR_FILE",
                     help="with --precision int8: static int8 calibrated on these batches: a "
                          "folder of .pt files (one batch each), a .pt file holding a list of "
                          "batches, or file.py:loader (an iterable of batches, e.g. a "
                          "DataLoader)")
    opt.add_argument("--memory-budget", default=None, metavar="SIZE",
                     help="with --train: the memory saved activations may take on the device, "
                          "e.g. 8GiB, 512MiB, bytes, or a fraction of device memory such as 0.5")
    opt.add_argument("--backend", choices=BACKENDS, default=None,
                     help="the one backend to execute the graphs with (default: the fastest "
                          "of --backends, measured)")
    opt.add_argument("--backends", default=None, metavar="NAMES",
                     help=f"comma-separated backends to measure and choose from (default: "
                          f"{','.join(BACKENDS)}, or $AUTOOPT_BACKENDS)")
    opt.add_argument("--no-verify", action="store_true", help="skip checking against eager")
    opt.add_argument("--save", metavar="PATH.pt2",
                     help="save the optimized graph as a torch.export program; load it with "
                          "torch.export.load(PATH).module(), which takes named --input's as "
                          "keywords (module(input_ids=ids))")


def run(args: argparse.Namespace) -> int:
    from autoopt.api import optimize
    from autoopt.capture.program import save_program

    budget = None
    if args.memory_budget is not None:
        if not args.train:
            raise ConfigError("--memory-budget limits the activations saved for a training "
                              "step; add --train (inference saves none)")
        budget = parse_budget_option(args.memory_budget)
    if args.save and args.save.lower().endswith(".onnx"):
        # torch.save's archive under an .onnx name: ONNX Runtime cannot open what it writes.
        raise ConfigError(f"--save writes a torch.export program (.pt2), not ONNX: "
                          f"{args.save!r}. For an ONNX file run 'autoopt export' with the "
                          f"same model, or name the file .pt2.")
    check_output(args.save, "--save")
    calibration = None
    if args.calibration is not None:
        if args.precision != "int8":
            raise ConfigError("--calibration gives static int8 its activation ranges; add "
                              "--precision int8")
        from autoopt.cli.loading import load_calibration

        calibration = load_calibration(args.calibration)
    dims = set(args.dynamic)
    model, inputs, kwargs = load_workload(args, train=args.train,
                                          dynamic=() if "all" in dims else tuple(dims))
    shapes = (named_dynamic_shapes(model, inputs, kwargs, sorted(dims))
              if dims and "all" not in dims else None)
    stage("optimizing: capture, passes, verification")
    optimized = optimize(model, inputs, kwargs, device=args.device, dynamic="all" in dims,
                         dynamic_shapes=shapes, disable=disabled(args),
                         verify=not args.no_verify, precision=args.precision,
                         memory_budget=budget, backend=args.backend, calibration=calibration,
                         backends=args.backends.split(",") if args.backends else None)
    if optimized.report.deferred:  # a model that generates: the command shows its forward
        import torch

        stage("optimizing the forward: capture, passes, verification")
        with torch.no_grad():
            optimized.specialization_for(inputs, kwargs)
    output(str(optimized.report))
    if args.save:
        stage(f"saving {args.save}")
        save_program(optimized, inputs, kwargs, args.save)
        output(f"saved {args.save}" + (" (dynamic dimensions kept)" if dims else ""))
    return 0
