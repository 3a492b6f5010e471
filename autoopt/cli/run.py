"""``autoopt run``: run an ONNX file under ONNX Runtime on random inputs; print the outputs'
shapes and, with ``--bench N``, the median latency and throughput."""

from __future__ import annotations

import argparse
import statistics
import time
from typing import TYPE_CHECKING

from autoopt.cli.common import add_common_arguments, check_threads
from autoopt.cli.progress import output, stage

if TYPE_CHECKING:  # imported where used: building the parsers (--help) imports no torch
    import torch

    from autoopt.onnx.session import OnnxSession


def add_parser(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("run", help="run an ONNX model under ONNX Runtime on random inputs")
    parser.add_argument("model", metavar="MODEL.onnx", help="the ONNX file")
    parser.add_argument("--input", action="append", required=True, metavar="[NAME=]SHAPE[:DTYPE]",
                     help="an input, e.g. input_ids=1x128; the dtype defaults to the model's")
    parser.add_argument("--int-high", type=int, default=100,
                     help="integer inputs are drawn from [0, INT_HIGH) (token ids)")
    parser.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N")
    parser.add_argument("--bench", type=int, default=0, metavar="N",
                     help="time N runs after warm-up; print median latency and throughput")
    add_common_arguments(parser, threads_help="ONNX Runtime intra-op threads")


def run(args: argparse.Namespace) -> int:
    import torch

    from autoopt.onnx.session import onnx_session

    threads = check_threads(args.threads)
    stage(f"loading {args.model}")
    session = onnx_session(args.model, device=args.device, threads=threads)
    device = torch.device(args.device)
    feeds = {name: t.to(device) for name, t in _feeds(session, args.input,
                                                      args.int_high).items()}
    stage("running")
    outputs = session.run(feeds)
    output(f"providers: {', '.join(session.providers)}")
    for name, value in outputs.items():
        dtype = str(value.dtype).removeprefix("torch.")
        output(f"{name}: {dtype}[{', '.join(map(str, value.shape))}]")
    if args.bench > 0:
        stage(f"timing {args.bench} runs")
        _bench(session, feeds, args.bench, device)
    return 0


def _bench(session: OnnxSession, feeds: dict[str, torch.Tensor], runs: int,
           device: torch.device) -> None:
    import torch

    for _ in range(min(runs, 3)):  # warm-up: first runs allocate and tune
        session.run(feeds)
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        session.run(feeds)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    median = statistics.median(times)
    first = next(iter(feeds.values()), None)
    batch = first.shape[0] if first is not None and first.dim() else 1
    output(f"latency: median {median * 1e3:.3f} ms over {runs} runs "
           f"(min {min(times) * 1e3:.3f} ms)")
    output(f"throughput: {batch / median:.1f} samples/s (batch {batch})")


def _feeds(session: OnnxSession, specs: list[str], int_high: int) -> dict[str, torch.Tensor]:
    """``--input`` specs -> tensors named after the model's inputs; a spec's dtype defaults
    to the model's input type and unnamed specs fill the inputs in order."""
    import torch

    from autoopt.cli.loading import parse_input
    from autoopt.errors import InputError

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
