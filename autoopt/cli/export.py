"""``autoopt export``: optimize a model for inference, export it to ONNX and check the file
under ONNX Runtime against eager PyTorch; print the report."""

from __future__ import annotations

import argparse

from autoopt.cli.common import (
    add_dynamic_argument,
    add_model_arguments,
    check_output,
    load_workload,
)
from autoopt.cli.names import EXPORTERS
from autoopt.cli.progress import output, stage


def add_parser(sub: argparse._SubParsersAction) -> None:
    exp = sub.add_parser("export", help="optimize a model, export it to ONNX, check it under "
                                        "ONNX Runtime; print a report")
    add_model_arguments(exp, device="none")
    exp.add_argument("-o", "--output", required=True, metavar="PATH.onnx",
                     help="the ONNX file to write")
    add_dynamic_argument(exp)
    exp.add_argument("--opset", type=int, default=None, help="ONNX opset (default: exporter's)")
    exp.add_argument("--exporter", default="auto", choices=EXPORTERS,
                     help="auto: torch.export-based (dynamo), falling back to TorchScript")
    exp.add_argument("--no-verify", action="store_true",
                     help="skip comparing ONNX Runtime with eager PyTorch")


def run(args: argparse.Namespace) -> int:
    from autoopt.export.onnx import export_onnx
    from autoopt.onnx.signature import DYNAMIC_DIMS

    check_output(args.output, "-o")
    # ONNX files name their dynamic dimensions, so "all" is every dimension export_onnx names.
    dims = DYNAMIC_DIMS if "all" in args.dynamic else tuple(dict.fromkeys(args.dynamic))
    model, inputs, kwargs = load_workload(args, dynamic=dims)
    stage("optimizing, exporting to ONNX, checking under ONNX Runtime")
    report = export_onnx(model, inputs, args.output, example_kwargs=kwargs, dynamic=dims,
                         opset=args.opset, verify=not args.no_verify, exporter=args.exporter)
    output(str(report))
    return 0
