"""Reduced precision on the CPU: bf16 and int8 against fp32 eager, same run.

    python bench/precision.py [--threads 1] [--rounds 5] [--models resnet50,bert-base] [--write]

Full-size models with random weights (resnet50 on 8 images of 224×224, BERT-base on 8 sequences
of 128 tokens). For each model, eager fp32 and ``autoopt.optimize(..., precision=p)`` for each
precision are timed round-robin (interleaved, so drift of this shared machine hits all alike);
the median per runner is kept. Reported: median latency, speedup over eager, the end-to-end
error on a fresh input (max |error| / max |fp32 output|), ops cast and kept in fp32, and the
optimize time. ``--write`` updates docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
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
from torch import nn

import autoopt

transformers.logging.set_verbosity_error()
sys.path.insert(0, str(Path(__file__).resolve().parent))
from cost_model_accuracy import first_tensor, publish  # noqa: E402

Case = tuple[nn.Module, tuple[Any, ...], dict[str, Any]]


def _resnet50(batch: int) -> Case:
    return torchvision.models.resnet50().eval(), (torch.randn(batch, 3, 224, 224),), {}


def _bert_base(batch: int) -> Case:
    ids = torch.randint(0, 30522, (batch, 128))
    model = transformers.BertModel(transformers.BertConfig()).eval()
    return model, (ids,), {"attention_mask": torch.ones_like(ids)}


MODELS: dict[str, tuple[Callable[[int], Case], tuple[str, ...]]] = {
    "resnet50": (_resnet50, ("bf16",)),
    # int8@0.1: a looser tolerance, so every linear may be int8 (the speed int8 can reach).
    "bert-base": (_bert_base, ("bf16", "int8", "int8@0.1")),
}


def _error(expected: torch.Tensor, actual: torch.Tensor) -> float:
    return float((actual.double() - expected.double()).abs().max() / expected.abs().max())


def bench_one(name: str, batch: int, rounds: int, device: str = "cpu",
              precisions: tuple[str, ...] | None = None) -> list[dict[str, Any]]:
    make, default_precisions = MODELS[name]
    model, args, kwargs = make(batch)
    model = model.to(device)
    args = tuple(a.to(device) for a in args)
    kwargs = {k: v.to(device) for k, v in kwargs.items()}
    runners: dict[str, Callable[[], Any]] = {"fp32 eager": lambda: model(*args, **kwargs)}
    facts: dict[str, dict[str, Any]] = {"fp32 eager": {}}
    fresh_args = tuple(torch.randint_like(a, 0, 1000) if not a.is_floating_point()
                       else torch.randn_like(a) for a in args)
    with torch.no_grad():
        expected = first_tensor(model(*fresh_args, **kwargs))
        for choice in precisions or default_precisions:
            precision, _, tolerance = choice.partition("@")
            start = time.perf_counter()
            key = f"autoopt {precision}" + (f" (tolerance {tolerance})" if tolerance else "")
            try:
                fast = autoopt.optimize(model, args, kwargs, precision=precision,
                                        tolerance=float(tolerance) if tolerance else None)
            except autoopt.ConfigError as exc:  # cannot apply here: no row; stderr says why
                print(f"{name}: {key}: {exc}", file=sys.stderr)
                continue
            seconds = time.perf_counter() - start
            summary = fast.report.captures[0].precision
            runners[key] = lambda fast=fast: fast(*args, **kwargs)
            facts[key] = {
                "optimize_s": seconds,
                "error": _error(expected, first_tensor(fast(*fresh_args, **kwargs))),
                "cast": summary.low_ops if summary else 0,
                "kept": len([k for k in summary.kept if "policy" not in k.why]) if summary
                else 0,
                "note": "; ".join(fast.report.warnings)[:80],
            }
        samples: dict[str, list[float]] = {k: [] for k in runners}
        for fn in runners.values():  # warm-up
            fn()
        for _ in range(rounds):
            for key, fn in runners.items():
                samples[key].append(_seconds(fn, device))
    eager = statistics.median(samples["fp32 eager"])
    rows = []
    for key, times in samples.items():
        median = statistics.median(times)
        rows.append({"model": name, "batch": batch, "runner": key, "median_s": median,
                     "speedup": eager / median, **facts[key]})
    return rows


def _seconds(fn: Callable[[], Any], device: str) -> float:
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def gpu_rows(rounds: int = 10) -> list[str]:
    """The CUDA table for ``bench/gpu_check.py``: fp16 and bf16 over fp32 eager, resnet50 at
    batch 32 and BERT-base at batch 8 (sequence 128)."""
    torch.manual_seed(0)
    rows = bench_one("resnet50", 32, rounds, "cuda", ("fp16", "bf16"))
    rows += bench_one("bert-base", 8, rounds, "cuda", ("fp16", "bf16"))
    name = torch.cuda.get_device_name()
    text = table(rows, torch.get_num_threads(), rounds,
                 "python bench/gpu_check.py --out OUT (precision_speedups)")
    title = f"## Reduced precision (CUDA, {name})"
    return text.replace("## Reduced precision (CPU)", title).splitlines()


def table(rows: list[dict[str, Any]], threads: int, rounds: int, command: str) -> str:
    lines = [
        "## Reduced precision (CPU)", "",
        f"`{command}` — {platform.processor() or platform.machine()}, torch "
        f"{torch.__version__}, {threads} thread(s), median of {rounds} interleaved rounds; "
        "speedup = fp32 eager median / runner median; error = max |error| / max |fp32 output| "
        "on a fresh input (default tolerances: bf16 2e-2, int8 5e-2); cast = compute ops in "
        "the low precision, kept = candidates kept in fp32 by measurement.", "",
        "| model | batch | runner | median (s) | speedup | error | cast | kept | optimize (s) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        extra = (f"{r['error']:.2g} | {r['cast']} | {r['kept']} | {r['optimize_s']:.1f}"
                 if "error" in r else "— | — | — | —")
        lines.append(f"| {r['model']} | {r['batch']} | {r['runner']} | {r['median_s']:.3f} | "
                     f"{r['speedup']:.2f}x | {extra} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--write", action="store_true", help="update docs/benchmarks.md")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    rows = [row for name in args.models.split(",")
            for row in bench_one(name, args.batch, args.rounds)]
    command = ("python bench/precision.py " + " ".join(sys.argv[1:])).strip()
    section = table(rows, args.threads, args.rounds, command)
    publish(section, write=args.write)
    return 0


if __name__ == "__main__":
    sys.exit(main())
