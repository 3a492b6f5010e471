"""Setup of a backend choice predicted from similar graphs, against the full measurement.

    python bench/prediction.py [--sequence resnet50:1,resnet50:2,...] [--threads 1] [--write]

A user optimizes a sequence of models on one machine. Each item of ``--sequence`` (model:batch,
in order; models of bench/inference.py or any torchvision classifier by name) is optimized in
fresh processes, each timing ``optimize`` plus a first call:

- **full**: with an empty autoopt cache, so every candidate is built and measured;
- **predicted**: with the cache the sequence's earlier items left (their graphs' choices), so
  that a graph similar to one measured before has the candidates far behind there left out
  (``autoopt/backends/prediction.py``);
- **OpenVINO**: its own ``convert_model`` and ``compile_model`` (latency hint) and a first
  call, the yardstick of issue 49's setup target.

Per item: the setup times, each run's chosen backend, what the prediction left out, and the
cost of a wrong pick: the full run's time for the predicted run's choice over the time of its
own choice (1.00 where both chose alike). Load average as each item ended. Inductor's cache is
empty for every run.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torchvision

sys.path.insert(0, str(Path(__file__).resolve().parent))
import child_process  # noqa: E402
import inference  # noqa: E402
from cost_model_accuracy import publish  # noqa: E402
from static_int8 import _cpu  # noqa: E402

HEADING = "## Backend choice predicted from similar graphs (issue 49)"
SEQUENCE = ("resnet50:1,resnet50:2,resnet101:1,resnet34:1,mobilenet_v3_large:1,"
            "mobilenet_v3_large:2,bert-base:1,bert-base:2,gpt2:1")


def build(name: str, batch: int) -> tuple[Any, tuple, dict]:
    if name not in inference.MODELS:
        inference.MODELS[name] = inference._image(getattr(torchvision.models, name))
    return inference._build_model(name, batch, "cpu")


def child(args: argparse.Namespace) -> int:
    torch.set_num_threads(args.threads)
    name, batch = args.child.split(":")
    model, inputs, kwargs = build(name, int(batch))
    with torch.no_grad():
        start = time.perf_counter()
        if args.openvino:
            import openvino as ov

            converted = ov.convert_model(model, example_input=inputs)
            compiled = ov.Core().compile_model(converted, "CPU", {
                "PERFORMANCE_HINT": "LATENCY", "INFERENCE_NUM_THREADS": args.threads})
            compiled([x.numpy() for x in inputs])
            child_process.report({"setup_s": time.perf_counter() - start})
            return 0
        import autoopt

        fast = autoopt.optimize(model, inputs, kwargs)
        fast(*inputs, **kwargs)
        setup = time.perf_counter() - start
    choice = fast.report.backends[0]
    child_process.report({"setup_s": setup, "chosen": choice.chosen,
                          "seconds": dict(choice.seconds),
                          "out": sorted(n for n, why in choice.skipped.items()
                                        if why.startswith("predicted out"))})
    return 0


def run_child(item: str, threads: int, cache: str, openvino: bool = False) -> dict[str, Any]:
    command = [sys.executable, str(Path(__file__).resolve()), "--child", item,
               "--threads", str(threads)] + (["--openvino"] if openvino else [])
    # Inductor's own cache empty too: a run does not find the kernels an earlier one compiled.
    with tempfile.TemporaryDirectory(prefix="autoopt-bench-inductor-") as inductor:
        env = {**os.environ, "XDG_CACHE_HOME": cache, "AUTOOPT_PROGRESS": "0",
               "TORCHINDUCTOR_CACHE_DIR": inductor}
        result = child_process.run(command, env, 3600)
    if "error" in result:
        print(f"  {item}: {result['error']}", file=sys.stderr)
    return result


def table(rows: list[dict[str, Any]], threads: int, command: str) -> str:
    lines = [HEADING, "",
             f"{_cpu()}, {threads} thread(s), {time.strftime('%Y-%m-%d')}. `{command}`. Each "
             "item in fresh processes: *full* with an empty autoopt cache (every candidate "
             "built and measured), *predicted* with the cache the items above it left, "
             "OpenVINO's own convert + compile + first call. *Pick's cost*: the full run's "
             "time for the predicted run's choice over its own choice's.", "",
             "| model | batch | full setup s (chosen) | predicted setup s (chosen) | left out | "
             "pick's cost | OpenVINO setup s | predicted ÷ OpenVINO | load |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        full, pred, ov = r["full"], r["predicted"], r["openvino"]
        if "error" in full or "error" in pred:
            lines.append(f"| {r['model']} | {r['batch']} | {full.get('error', '')} | "
                         f"{pred.get('error', '')} | | | | | {r['load']:.2f} |")
            continue
        seconds = full["seconds"]
        cost = (seconds[pred["chosen"]] / seconds[full["chosen"]]
                if pred["chosen"] in seconds and full["chosen"] in seconds else float("nan"))
        ov_s = ov.get("setup_s", float("nan"))
        lines.append(
            f"| {r['model']} | {r['batch']} | {full['setup_s']:.1f} ({full['chosen']}) | "
            f"{pred['setup_s']:.1f} ({pred['chosen']}) | {', '.join(pred['out']) or '-'} | "
            f"{cost:.2f} | {ov_s:.1f} | {pred['setup_s'] / ov_s:.1f}x | {r['load']:.2f} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sequence", default=SEQUENCE)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--write", action="store_true", help="update docs/benchmarks.md")
    parser.add_argument("--out", type=Path, help="also write the table to this file")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--openvino", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args)
    rows = []
    with tempfile.TemporaryDirectory(prefix="autoopt-bench-shared-") as shared:
        for item in args.sequence.split(","):
            name, batch = item.split(":")
            print(f"{item} ...", file=sys.stderr)
            with tempfile.TemporaryDirectory(prefix="autoopt-bench-empty-") as empty:
                full = run_child(item, args.threads, empty)
            predicted = run_child(item, args.threads, shared)
            with tempfile.TemporaryDirectory(prefix="autoopt-bench-empty-") as empty:
                openvino = run_child(item, args.threads, empty, openvino=True)
            rows.append({"model": name, "batch": int(batch), "full": full,
                         "predicted": predicted, "openvino": openvino,
                         "load": os.getloadavg()[0]})
            print(table(rows[-1:], args.threads, "").splitlines()[-1], file=sys.stderr)
    command = "python bench/prediction.py " + " ".join(sys.argv[1:])
    publish(table(rows, args.threads, command.strip()), write=args.write, out=args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
