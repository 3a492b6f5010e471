"""fp32 linear kernels on this CPU: ATen (MKL, weight unpacked) against the packed kernels.

    python bench/linear_kernels.py [--threads 1] [--rounds 15] [--write] [--out table.md]

For the linear shapes of BERT-base, ViT-B/16 and GPT-2 (sequence 128, batch 1 and 8), each
kernel is timed round-robin (interleaved medians) on the same input: ``aten.linear`` (what eager
PyTorch runs), MKL's GEMM on a weight packed once and oneDNN's linear on a weight reordered
once into its blocked layout (``packed_linear``'s two kernels; each only where the build has
it). GFLOP/s = 2·M·K·N / median; the max error is against an
fp64 reference. It shows what the ``packed_linear`` pass chooses from, and how close fp32
matmuls already are to this CPU's ceiling.
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
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cost_model_accuracy import publish  # noqa: E402

# (where the shape comes from, rows M, in K, out N): M = batch × tokens.
SHAPES = [
    ("BERT/GPT-2 attention out, batch 1", 128, 768, 768),
    ("BERT FFN up, batch 1", 128, 768, 3072),
    ("BERT FFN down, batch 1", 128, 3072, 768),
    ("BERT Q/K/V merged, batch 1", 128, 768, 2304),
    ("BERT/GPT-2 attention out, batch 8", 1024, 768, 768),
    ("BERT FFN up, batch 8", 1024, 768, 3072),
    ("BERT FFN down, batch 8", 1024, 3072, 768),
    ("ViT FFN up, batch 8", 1576, 768, 3072),
]


def kernels(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> dict[str, Callable[[], Any]]:
    rows = x.shape[0]
    found: dict[str, Callable[[], Any]] = {"aten": lambda: F.linear(x, w, b)}
    if torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_linear"):
        mkl = torch.ops.mkl._mkl_reorder_linear_weight(w, rows)
        found["mkl packed"] = lambda: torch.ops.mkl._mkl_linear(x, mkl, w, b, rows)
    if (torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")):
        onednn = torch.ops.mkldnn._reorder_linear_weight(w, rows)
        found["onednn packed"] = lambda: torch.ops.mkldnn._linear_pointwise(
            x, onednn, b, "none", [], "")
    return found


def bench_shape(m: int, k: int, n: int, rounds: int) -> dict[str, Any]:
    torch.manual_seed(0)
    x, w, b = torch.randn(m, k), torch.randn(n, k) / k**0.5, torch.randn(n)
    runs = kernels(x, w, b)
    reference = F.linear(x.double(), w.double(), b.double())
    errors = {name: float((run().double() - reference).abs().max()) for name, run in runs.items()}
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(rounds):
        for name, run in runs.items():
            start = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - start)
    median = {name: statistics.median(t) for name, t in times.items()}
    return {"median": median, "errors": errors, "flops": 2 * m * k * n}


def table(rows: list[tuple[str, int, int, int, dict[str, Any]]], threads: int,
          command: str) -> str:
    names = list(rows[0][4]["median"])
    lines = ["## fp32 linear kernels (CPU)", "", f"Command: `{command}`  ",
             f"Machine: {platform.processor() or platform.machine()}, {threads} thread(s), torch "
             f"{torch.__version__}. Median of interleaved rounds; GFLOP/s = 2·M·K·N / median; "
             "speedup = aten median / kernel median; err = max abs difference from an fp64 "
             "reference (weights scaled by 1/√K).", "",
             "| shape | M×K×N | " + " | ".join(names) + " | "
             + " | ".join(f"err {name}" for name in names) + " |",
             "|---|---|" + "---|" * (2 * len(names))]
    for label, m, k, n, r in rows:
        aten = r["median"]["aten"]
        cells = [f"{r['flops'] / t / 1e9:.0f} GFLOP/s ({aten / t:.2f}×)"
                 for t in r["median"].values()]
        errors = [f"{r['errors'][name]:.1e}" for name in names]
        lines.append(f"| {label} | {m}×{k}×{n} | " + " | ".join(cells + errors) + " |")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--write", action="store_true", help="update docs/benchmarks.md")
    parser.add_argument("--out", type=Path, help="also write the table to this file")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows = [(label, m, k, n, bench_shape(m, k, n, args.rounds)) for label, m, k, n in SHAPES]
    command = "python bench/linear_kernels.py " + " ".join(sys.argv[1:])
    publish(table(rows, args.threads, command.strip()), write=args.write, out=args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
