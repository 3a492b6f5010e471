"""Static int8 (``precision="int8", calibration=``) against OpenVINO + NNCF int8, same run.

    python bench/static_int8.py [--models resnet50,mobilenet_v3_large,bert] [--batches 1,8]
                                [--threads 1] [--calibration 32] [--rounds 7] [--write]

Also reached as ``python bench/inference.py --static-int8``. Models have random weights at full
size (images 224x224, BERT-base with 128 tokens). Per model and batch, in one process:

- eager fp32, the yardstick;
- OpenVINO at its default precision (bf16 where the CPU has it): ``openvino.convert_model``,
  compiled with a latency hint;
- OpenVINO + NNCF int8, as its users deploy it: ``nncf.quantize`` on the converted model with
  the same calibration batches autoopt gets (the transformer scheme for BERT);
- autoopt bf16 (``precision="bf16"``, backends aten and openvino: Inductor's compile is left
  out of this table's time);
- autoopt static int8 (``precision="int8", calibration=batches``).

The runners are timed round-robin (interleaved) and the median per runner kept; the error of
each int8 runner is measured on 8 held-out inputs (never in the calibration set) over every
output (BERT's pooler output too), each as verification measures it:
``max|out - eager| / max(1, max|eager|)``; for the classifiers also the top-1 agreement with
eager on them. Setup: NNCF's convert + quantize + compile; autoopt's optimize, cold.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torchvision
import transformers

import autoopt

transformers.logging.set_verbosity_error()
Inputs = tuple[tuple[Any, ...], dict[str, Any]]
DOCS = Path(__file__).resolve().parent.parent / "docs" / "benchmarks.md"
HEADING = "## Static int8 against OpenVINO + NNCF"
# The tolerance a row refused at int8's default runs at instead (marked in the table).
RETRY = 0.2


def image_model(name: str) -> Callable[[int, torch.Generator], tuple[Any, Callable[[], Inputs]]]:
    def make(batch: int, generator: torch.Generator) -> tuple[Any, Callable[[], Inputs]]:
        model = getattr(torchvision.models, name)().eval()
        return model, lambda: ((torch.randn(batch, 3, 224, 224, generator=generator),), {})
    return make


def bert(batch: int, generator: torch.Generator) -> tuple[Any, Callable[[], Inputs]]:
    model = transformers.BertModel(transformers.BertConfig()).eval()

    def inputs() -> Inputs:
        ids = torch.randint(0, 30522, (batch, 128), generator=generator)
        return (ids,), {"attention_mask": torch.ones_like(ids)}
    return model, inputs


MODELS = {"resnet50": image_model("resnet50"),
          "mobilenet_v3_large": image_model("mobilenet_v3_large"), "bert": bert}


def _flat(inputs: Inputs) -> dict[str, Any]:
    (x,), kwargs = inputs
    if not kwargs:
        return {"x": x.numpy()}
    return {"input_ids": x.numpy(), **{k: v.numpy() for k, v in kwargs.items()}}


def _openvino(model: Any, example: Inputs, calibration: list[Inputs] | None,
              threads: int, transformer: bool) -> Callable[[Inputs], Any]:
    import nncf
    import openvino as ov

    (x,), kwargs = example
    converted = ov.convert_model(model, example_input={"input_ids": x, **kwargs} if kwargs
                                 else x)
    if calibration is not None:
        names = [p.get_any_name() for p in converted.inputs]

        def feed(batch: Inputs) -> Any:
            flat = _flat(batch)
            return list(flat.values()) if len(names) == len(flat) else flat
        options = {"model_type": nncf.ModelType.TRANSFORMER} if transformer else {}
        converted = nncf.quantize(converted, nncf.Dataset(calibration, feed),
                                  subset_size=len(calibration), **options)
    compiled = ov.Core().compile_model(converted, "CPU", {
        "INFERENCE_NUM_THREADS": threads, "PERFORMANCE_HINT": "LATENCY", "NUM_STREAMS": 1})
    request = compiled.create_infer_request()

    def run(inputs: Inputs) -> Any:
        result = request.infer(list(_flat(inputs).values()), share_inputs=True)
        outputs = [torch.from_numpy(result[port].copy()) for port in compiled.outputs]
        return outputs[0] if len(outputs) == 1 else outputs
    return run


def _outputs(out: Any) -> list[torch.Tensor]:
    """Every floating output, in the model's order (BERT's last hidden state and pooler
    output; OpenVINO's outputs come in the same order)."""
    if isinstance(out, torch.Tensor):
        return [out.float()]
    items = out.values() if hasattr(out, "values") else out
    return [t.float() for t in items if isinstance(t, torch.Tensor) and t.is_floating_point()]


def _error(run: Callable[[Inputs], Any], eager: Callable[[Inputs], Any],
           held_out: list[Inputs]) -> tuple[float, str]:
    """The largest error over every output, each as verification measures it:
    ``max|out - eager| / max(1, max|eager|)``; and a classifier's top-1 agreement."""
    error, same, total = 0.0, 0, 0
    with torch.no_grad():
        for inputs in held_out:
            wants, gots = _outputs(eager(inputs)), _outputs(run(inputs))
            for want, got in zip(wants, gots, strict=True):
                error = max(error, float((want - got).abs().max())
                            / max(1.0, float(want.abs().max())))
            if len(wants) == 1 and wants[0].dim() == 2:
                same += int((wants[0].argmax(1) == gots[0].argmax(1)).sum())
                total += wants[0].shape[0]
    return error, f"{same}/{total}" if total else ""


def bench_row(name: str, batch: int, threads: int, batches: int, rounds: int) -> dict[str, Any]:
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(0)
    model, draw = MODELS[name](batch, generator)
    example = draw()
    calibration = [draw() for _ in range(batches)]
    held_out = [draw() for _ in range(8)]
    transformer = name == "bert"

    def eager(inputs: Inputs) -> Any:
        return model(*inputs[0], **inputs[1])

    runners: dict[str, Callable[[Inputs], Any]] = {"eager fp32": eager}
    setup: dict[str, float] = {}
    errors: dict[str, tuple[float, str]] = {}
    start = time.perf_counter()
    runners["OpenVINO default"] = _openvino(model, example, None, threads, transformer)
    setup["OpenVINO default"] = time.perf_counter() - start
    start = time.perf_counter()
    runners["OpenVINO+NNCF int8"] = _openvino(model, example, calibration, threads, transformer)
    setup["OpenVINO+NNCF int8"] = time.perf_counter() - start
    for label, options in (("autoopt bf16", {"precision": "bf16",
                                             "backends": ("aten", "openvino")}),
                           ("autoopt int8", {"precision": "int8", "calibration": calibration,
                                             "backends": ("openvino", "onnxruntime")})):
        start = time.perf_counter()
        with torch.no_grad():
            try:
                fast = autoopt.optimize(model, example[0], example[1], **options)
            except autoopt.ConfigError as refused:
                if label != "autoopt int8":
                    # bf16 refused (a CPU without a fast bf16 matmul): the cell says so.
                    setup[label] = f"refused: {str(refused)[:120]}"
                    print(setup[label], file=sys.stderr)
                    continue
                # Refused within int8's default tolerance: the row says so and runs at the
                # tolerance that lets it (the error column shows what it then errs by).
                setup["refused"] = f"refused at 0.05: {str(refused)[:300]}"
                print(setup["refused"], file=sys.stderr)
                start = time.perf_counter()
                fast = autoopt.optimize(model, example[0], example[1], tolerance=RETRY,
                                        **options)
        setup[label] = time.perf_counter() - start
        runners[label] = lambda inputs, fast=fast: fast(*inputs[0], **inputs[1])
        if label == "autoopt int8":
            setup["autoopt int8 engine"] = fast.report.backends[0].chosen
    for label in ("OpenVINO default", "OpenVINO+NNCF int8", "autoopt bf16", "autoopt int8"):
        if label in runners:
            errors[label] = _error(runners[label], eager, held_out)
    times: dict[str, list[float]] = {label: [] for label in runners}
    calls = 1 if batch > 1 or name == "bert" else 3
    with torch.no_grad():
        for run in runners.values():
            run(example)
        for _ in range(rounds):
            for label, run in runners.items():
                begin = time.perf_counter()
                for _ in range(calls):
                    run(example)
                times[label].append((time.perf_counter() - begin) / calls)
    return {"model": name, "batch": batch, "threads": threads,
            "ms": {k: 1e3 * statistics.median(v) for k, v in times.items()},
            "setup": setup, "errors": errors, "load": os.getloadavg()[0]}


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| model | batch | eager fp32 ms | OpenVINO default | OpenVINO+NNCF int8 | "
             "autoopt bf16 | autoopt int8 (engine) | int8 vs NNCF | error NNCF / autoopt "
             "(top-1) | setup s NNCF / autoopt int8 | load |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ms, err, setup = r["ms"], r["errors"], r["setup"]
        eager = ms["eager fp32"]

        def cell(label: str, ms: dict[str, float] = ms, eager: float = eager) -> str:
            if label not in ms:  # its reason went to stderr
                return "refused"
            return f"{ms[label]:.1f} ms ({eager / ms[label]:.2f}x)"
        nncf, ours = err["OpenVINO+NNCF int8"], err["autoopt int8"]
        top1 = f" ({nncf[1]} / {ours[1]})" if ours[1] else ""
        lines.append(
            f"| {r['model']} | {r['batch']} | {eager:.1f} | {cell('OpenVINO default')} | "
            f"{cell('OpenVINO+NNCF int8')} | {cell('autoopt bf16')} | "
            f"{cell('autoopt int8')} {setup['autoopt int8 engine']}"
            f"{f' (refused at 0.05; tolerance={RETRY})' if 'refused' in setup else ''} | "
            f"{ms['OpenVINO+NNCF int8'] / ms['autoopt int8']:.2f}x | "
            f"{nncf[0]:.3g} / {ours[0]:.3g}{top1} | "
            f"{setup['OpenVINO+NNCF int8']:.0f} / {setup['autoopt int8']:.0f} | "
            f"{r['load']:.2f} |")
    return "\n".join(lines)


def _cpu() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def write(text: str) -> None:
    docs = DOCS.read_text()
    if HEADING in docs:
        start = docs.index(HEADING)
        ends = [i for i in (docs.find("\n### ", start + 1), docs.find("\n## ", start + 1))
                if i != -1]
        end = min(ends) if ends else -1
        docs = docs[:start] + text + (docs[end:] if end != -1 else "\n")
    else:
        docs = docs.rstrip("\n") + "\n\n" + text + "\n"
    DOCS.write_text(docs)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--threads", default="1")
    parser.add_argument("--calibration", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--write", action="store_true", help="update docs/benchmarks.md")
    args = parser.parse_args(argv)
    rows = []
    for threads in (int(t) for t in args.threads.split(",")):
        torch.set_num_threads(threads)
        for name in args.models.split(","):
            for batch in (int(b) for b in args.batches.split(",")):
                print(f"static int8: {name} batch {batch}, {threads} thread(s)...",
                      file=sys.stderr, flush=True)
                rows.append(bench_row(name, batch, threads, args.calibration, args.rounds))
                print(table(rows[-1:]).splitlines()[-1], flush=True)
    command = "python bench/static_int8.py " + " ".join(argv if argv is not None
                                                         else sys.argv[1:])
    text = (f"{HEADING} ({_cpu()}, {args.threads} thread(s), {time.strftime('%Y-%m-%d')})\n\n"
            f"`{command.strip()}`: {args.calibration} calibration batches for both, errors on "
            f"8 held-out inputs (every output, max|out - eager| / max(1, max|eager|)), "
            f"medians of {args.rounds} interleaved rounds; the load "
            f"average (1 min) as each row ended.\n\n{table(rows)}\n")
    print(text)
    if args.write:
        write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
