"""A decode step's matrix-vector products on this CPU: every kernel ``packed_linear`` chooses
among, weights read from memory, in GB/s.

    python bench/decode_gemv.py [--threads 1] [--rounds 7] [--sweep-mib 256] [--write]

A decode step reads each weight once per token, and a model's weights outgrow the caches, so
a GEMV is as fast as it streams memory. For the linear shapes of the Llama-style decoder and
GPT-2 of ``bench/generate.py`` (one row of activations), each kernel runs over copies of the
weight that together span ``--sweep-mib`` (far beyond the last-level cache), interleaved
round by round, medians: ATen's linear, MKL's packed GEMM and oneDNN's reordered one, and
autoopt's own GEMVs (``fp32_rows``: 8 weight rows streamed at once, prefetched;
``fp32_stream``: one row after another; ``bf16_stream`` on bf16 weights); in bf16, oneDNN's
and FBGEMM's fp16 kernel beside ATen's. Each only where this build and CPU have it. GB/s =
bytes of weight read / median seconds; the last column is the fastest kernel's fraction of
the memory bandwidth ``bench/generate.py`` measures (a sum over a large tensor or the best
such GEMV, the faster), and each row records the load average it ran under.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cost_model_accuracy import heading, publish  # noqa: E402
from generate import bandwidth  # noqa: E402

from autoopt.passes.packed_kernels import (  # noqa: E402
    OWN_GEMV,
    PackedLinear,
    kernels,
    kernels_for,
    rows_kernel_fits,
)

# (where the shape comes from, out, in): the decode steps of bench/generate.py's models.
SHAPES = [
    ("Llama-style Q/K/V merged", 1280, 768),
    ("Llama-style attention out", 768, 768),
    ("Llama-style gate / up", 2048, 768),
    ("Llama-style down", 768, 2048),
    ("Llama-style output head", 32000, 768),
    ("GPT-2 Q/K/V", 2304, 768),
    ("GPT-2 MLP up", 3072, 768),
    ("GPT-2 MLP down", 768, 3072),
]


def candidates(weight: torch.Tensor) -> dict[str, Callable[[torch.Tensor], PackedLinear | None]]:
    """Each kernel this build has for the weight's dtype at one row, as a maker of its bound
    call on one copy of the weight (None: ATen's linear on the weight as it is)."""
    made: dict[str, Callable[[torch.Tensor], PackedLinear | None]] = {"aten": lambda w: None}
    for kernel in kernels(torch.device("cpu")):
        if kernel not in kernels_for(weight.dtype):
            continue
        if kernel in OWN_GEMV and not rows_kernel_fits(weight, 1):
            continue
        made[kernel] = lambda w, kernel=kernel: PackedLinear(w, 1, kernel)
    return made


def bench_shape(out: int, width: int, dtype: torch.dtype, rounds: int,
                sweep: int) -> dict[str, float]:
    """GB/s of each kernel on copies of an (out, width) weight spanning ``sweep`` bytes."""
    torch.manual_seed(out + width)
    weight = torch.randn(out, width).to(dtype)
    copies = max(2, -(-sweep // weight.nbytes))
    weights = [weight.clone() for _ in range(copies)]
    x = torch.randn(1, 1, width).to(dtype)
    runs: dict[str, Callable[[], Any]] = {}
    for name, make in candidates(weight).items():
        bound = [make(w) for w in weights]
        if bound[0] is None:
            runs[name] = lambda: [torch.nn.functional.linear(x, w) for w in weights]
        else:
            runs[name] = lambda bound=bound: [k(x, None) for k in bound]
    samples: dict[str, list[float]] = {name: [] for name in runs}
    with torch.no_grad():
        for run in runs.values():  # warm-up: first calls allocate
            run()
        for _ in range(rounds):
            for name, run in runs.items():
                start = time.perf_counter()
                run()
                samples[name].append(time.perf_counter() - start)
    read = copies * weight.nbytes
    return {name: read / statistics.median(s) / 1e9 for name, s in samples.items()}


Row = tuple[str, int, int, torch.dtype, dict[str, float], float]  # ..., speeds, load


def table(rows: list[Row], bytes_per_s: float) -> str:
    names = list(dict.fromkeys(k for row in rows for k in row[4]))
    lines = ["| shape | out x in | dtype | " + " | ".join(names)
             + " | fastest | of bandwidth | load |",
             "|---|---|---|" + "---|" * len(names) + "---|---|---|"]
    for where, out, width, dtype, speeds, load in rows:
        best = max(speeds, key=speeds.__getitem__)
        cells = [f"{speeds[n]:.1f}" if n in speeds else "-" for n in names]
        lines.append(f"| {where} | {out} x {width} | {str(dtype).split('.')[-1]} | "
                     + " | ".join(cells)
                     + f" | {best} | {speeds[best] * 1e9 / bytes_per_s:.0%} | {load:.2f} |")
    return "\n".join(lines)


def run(threads: int, rounds: int, sweep_mib: int, shapes: list[tuple[str, int, int]] = SHAPES,
        dtypes: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16),
        ) -> tuple[list[Row], float]:
    torch.set_num_threads(threads)
    bytes_per_s = bandwidth(torch.device("cpu"))
    rows = []
    for dtype in dtypes:
        for where, out, width in shapes:
            speeds = bench_shape(out, width, dtype, rounds, sweep_mib * 2**20)
            print(f"[{where}, {dtype}] " + ", ".join(f"{k} {v:.1f} GB/s"
                                                     for k, v in speeds.items()), flush=True)
            # The 1-minute load average as the row ended: about the thread count alone; more,
            # other jobs shared the cores and the row is not a quiet machine's.
            rows.append((where, out, width, dtype, speeds, os.getloadavg()[0]))
    return rows, bytes_per_s


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--sweep-mib", type=int, default=256)
    parser.add_argument("--write", action="store_true",
                        help="append the table to docs/benchmarks.md")
    parser.add_argument("--out", type=Path, help="write the table to this file instead")
    args = parser.parse_args()
    rows, bytes_per_s = run(args.threads, args.rounds, args.sweep_mib)
    title, machine = heading("Decode-step GEMVs", torch.device("cpu"))
    command = "python bench/decode_gemv.py " + " ".join(sys.argv[1:])
    publish(f"{title}\n\n`{command}` — {machine}, {args.threads} thread(s), torch "
            f"{torch.__version__}. GB/s of weight read, one row of activations, weights from "
            f"memory ({args.sweep_mib} MiB swept per kernel and round, {args.rounds} "
            f"interleaved rounds, medians); measured memory bandwidth "
            f"{bytes_per_s / 1e9:.1f} GB/s.\n\n{table(rows, bytes_per_s)}\n",
            write=args.write, out=args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
