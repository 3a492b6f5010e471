"""The ``autoopt`` command line."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

import torch

from .errors import AutoOptError, ConfigError
from .onnx import DYNAMIC_DIMS, EXPORTERS, OnnxSession


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

    exp = sub.add_parser("export", help="optimize a model, export it to ONNX, check it under "
                                        "ONNX Runtime; print a report")
    exp.add_argument("model", help="package.module:factory, path/to/file.py:Name, or model.pt2")
    exp.add_argument("--input", action="append", required=True, metavar="[NAME=]SHAPE[:DTYPE]",
                     help="an example input, e.g. 1x3x224x224 or input_ids=1x128:int64; repeat "
                          "for several inputs")
    exp.add_argument("-o", "--output", required=True, metavar="PATH.onnx",
                     help="the ONNX file to write")
    exp.add_argument("--dtype", default="float32", help="dtype of inputs that name none")
    exp.add_argument("--int-high", type=int, default=100,
                     help="integer inputs are drawn from [0, INT_HIGH) (token ids)")
    exp.add_argument("--dynamic", action="append", default=[], choices=DYNAMIC_DIMS,
                     help="leave a dimension symbolic: batch (dim 0 of every input), sequence "
                          "(dim 1 of integer inputs); repeatable")
    exp.add_argument("--opset", type=int, default=None, help="ONNX opset (default: exporter's)")
    exp.add_argument("--exporter", default="auto", choices=EXPORTERS,
                     help="auto: torch.export-based (dynamo), falling back to TorchScript")
    exp.add_argument("--no-verify", action="store_true",
                     help="skip comparing ONNX Runtime with eager PyTorch")
    exp.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    exp.add_argument("-v", "--verbose", action="store_true")

    run = sub.add_parser("run", help="run an ONNX model under ONNX Runtime on random inputs")
    run.add_argument("model", metavar="MODEL.onnx", help="the ONNX file")
    run.add_argument("--input", action="append", required=True, metavar="[NAME=]SHAPE[:DTYPE]",
                     help="an input, e.g. input_ids=1x128; the dtype defaults to the model's")
    run.add_argument("--int-high", type=int, default=100,
                     help="integer inputs are drawn from [0, INT_HIGH) (token ids)")
    run.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N")
    run.add_argument("--threads", type=int, default=None, help="ONNX Runtime intra-op threads")
    run.add_argument("--bench", type=int, default=0, metavar="N",
                     help="time N runs after warm-up; print median latency and throughput")
    run.add_argument("-v", "--verbose", action="store_true")
    _add_diagnosis_commands(sub)
    _add_partition_command(sub)
    return parser


def _add_partition_command(sub: argparse._SubParsersAction) -> None:
    """``autoopt partition`` (autoopt/pipelining.py)."""
    part = sub.add_parser("partition", help="cut a model into pipeline stages balanced by "
                                            "measured time; print the stage table")
    part.add_argument("model", help="package.module:factory, path/to/file.py:Name, or .pt2")
    part.add_argument("--input", action="append", required=True, metavar="[NAME=]SHAPE[:DTYPE]",
                      help="an example input (one microbatch), e.g. 1x3x224x224; repeatable")
    part.add_argument("--dtype", default="float32", help="dtype of inputs that name none")
    part.add_argument("--int-high", type=int, default=100, help="integer inputs: [0, N)")
    part.add_argument("--stages", type=int, required=True, help="pipeline stages (K)")
    part.add_argument("--devices", default=None, help="comma-separated, one per stage "
                      "(default: cpu for each)")
    part.add_argument("--memory", default=None, help="each device's memory, e.g. 16GiB")
    part.add_argument("--microbatches", type=int, default=1, help="microbatches in flight")
    part.add_argument("--plot", metavar="PATH.png", help="a per-stage time/memory bar chart "
                      "(needs matplotlib)")
    part.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    part.add_argument("-v", "--verbose", action="store_true")


def _add_diagnosis_commands(sub: argparse._SubParsersAction) -> None:
    """``autoopt diagnose`` and ``autoopt report`` (autoopt/diagnose.py, html_report.py)."""
    diag = sub.add_parser("diagnose", help="run a workload; say why the device is idle and "
                                           "which option fixes it")
    rep = sub.add_parser("report", help="optimize, diagnose and time a model; write one "
                                        "self-contained HTML report with charts")
    for p in (diag, rep):
        p.add_argument("model", help="package.module:factory, path/to/file.py:Name, or .pt2")
        p.add_argument("--input", action="append", default=[], metavar="[NAME=]SHAPE[:DTYPE]",
                       help="an example input, e.g. 1x3x224x224; repeat for several")
        p.add_argument("--dtype", default="float32", help="dtype of inputs that name none")
        p.add_argument("--int-high", type=int, default=100, help="integer inputs: [0, N)")
        p.add_argument("--device", default=None, help="cpu, cuda, cuda:N (default: model's)")
        p.add_argument("--training", action="store_true", help="forward and backward steps")
        p.add_argument("--steps", type=int, default=10, help="timed steps")
        p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
        p.add_argument("-v", "--verbose", action="store_true")
    diag.add_argument("--loader", metavar="FILE.py:NAME", help="batches from a DataLoader "
                      "(or a function returning one) instead of --input")
    diag.add_argument("--interval", type=float, default=0.05, help="seconds between "
                      "utilization samples")
    diag.add_argument("--apply", action="store_true", help="optimize with the fixes found; "
                      "show before/after")
    rep.add_argument("-o", "--output", required=True, metavar="PATH.html")
    rep.add_argument("--title", default=None, help="the report's heading (default: MODEL)")
    rep.add_argument("--disable", action="append", default=[], metavar="PASS",
                     help="leave a pass out (repeatable)")


# The file each command writes, as (attribute, option): checked before the work starts.
_OUTPUTS = {"optimize": ("save", "--save"), "profile": ("json", "--json"),
            "export": ("output", "-o"), "report": ("output", "-o"),
            "partition": ("plot", "--plot")}


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        _check_output(args)
        if args.command == "optimize":
            return _optimize(args)
        if args.command == "profile":
            from .profiling import profile_command

            return profile_command(args)
        if args.command == "export":
            return _export(args)
        if args.command == "run":
            return _run(args)
        if args.command == "partition":
            from .pipelining import partition_command

            return partition_command(args)
        if args.command == "diagnose":
            from .diagnose import diagnose_command

            return diagnose_command(args)
        if args.command == "report":
            from .html_report import report_command

            return report_command(args)
    except AutoOptError as exc:
        print(f"autoopt: error: {exc}", file=sys.stderr)
        return 2
    return 1


def _check_output(args: argparse.Namespace) -> None:
    """Make the output's folder and check the file can be written, so that a bad path fails
    in a second, not after minutes of optimizing and measuring."""
    from .onnx import check_writable

    attribute, option = _OUTPUTS.get(args.command, (None, None))
    value = getattr(args, attribute, None) if attribute else None
    if not value:
        return
    path = Path(value)
    if path.is_dir():
        raise ConfigError(f"{option} {value!r} is a directory; give a file name")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"{option} {value!r}: cannot create the folder {str(path.parent)!r} "
                          f"({exc.strerror or exc}); choose a writable path.") from exc
    check_writable(path, f"{option} {value!r}")


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
        print(f"saved {args.save}" + (" (dynamic dimensions kept)" if args.dynamic else ""))
    return 0


def _export(args: argparse.Namespace) -> int:
    from .loading import load_model, model_inputs
    from .onnx import export_onnx

    if args.threads:
        torch.set_num_threads(args.threads)
    model = load_model(args.model)
    inputs, kwargs = model_inputs(args.input, args.dtype, args.int_high)
    report = export_onnx(model, inputs, args.output, example_kwargs=kwargs,
                         dynamic=tuple(args.dynamic), opset=args.opset,
                         verify=not args.no_verify, exporter=args.exporter)
    print(report)
    return 0


def _run(args: argparse.Namespace) -> int:
    import statistics
    import time

    from .onnx import onnx_session

    session = onnx_session(args.model, device=args.device, threads=args.threads)
    feeds = _onnx_feeds(session, args.input, args.int_high)
    device = torch.device(args.device)
    feeds = {name: t.to(device) for name, t in feeds.items()}
    outputs = session.run(feeds)
    print(f"providers: {', '.join(session.providers)}")
    for name, value in outputs.items():
        dtype = str(value.dtype).removeprefix("torch.")
        print(f"output {name}: {dtype}[{', '.join(map(str, value.shape))}]")
    if args.bench > 0:
        for _ in range(min(args.bench, 3)):  # warm-up: first runs allocate and tune
            session.run(feeds)
        times = []
        for _ in range(args.bench):
            start = time.perf_counter()
            session.run(feeds)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times.append(time.perf_counter() - start)
        median = statistics.median(times)
        first = next(iter(feeds.values()), None)
        batch = first.shape[0] if first is not None and first.dim() else 1
        print(f"latency: median {median * 1e3:.3f} ms over {args.bench} runs "
              f"(min {min(times) * 1e3:.3f} ms)")
        print(f"throughput: {batch / median:.1f} samples/s (batch {batch})")
    return 0


def _onnx_feeds(session: OnnxSession, specs: list[str], int_high: int,
                ) -> dict[str, torch.Tensor]:
    """``--input`` specs -> tensors named after the model's inputs; a spec's dtype defaults
    to the model's input type and unnamed specs fill the inputs in order."""
    from .errors import InputError
    from .loading import parse_input

    names = session.input_names
    feeds: dict[str, torch.Tensor] = {}
    for position, spec in enumerate(specs):
        name = spec.split("=", 1)[0] if "=" in spec else None
        if name is None and position >= len(names):
            raise InputError(f"--input {spec!r}: the model has only {len(names)} input(s): "
                             f"{names}")
        target = name if name is not None else names[position]
        if target not in names:
            raise InputError(f"--input {spec!r}: the model has no input {target!r}; its "
                             f"inputs are {names}")
        if target in feeds:
            raise InputError(f"--input {spec!r}: input {target!r} is given twice; give each "
                             f"input once")
        dtype = session.input_types.get(target) or torch.float32
        _, tensor = parse_input(spec, str(dtype).removeprefix("torch."), int_high)
        feeds[target] = tensor
    return feeds


if __name__ == "__main__":
    sys.exit(main())
