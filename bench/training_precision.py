"""Training step in reduced precision on CUDA: eager fp32, ``torch.autocast`` bf16, autoopt.

    python bench/training_precision.py [--batch 64] [--rounds 10]

resnet50 (random weights) training at batch 64 with cross-entropy: one forward + backward
per step, median of interleaved rounds. Prints a table (bench/gpu_check.py runs it and
docs/benchmarks.md holds its result, under the GPU utilization section); needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

import autoopt


def gpu_rows(batch: int = 64, rounds: int = 10) -> list[str]:
    import torchvision

    torch.manual_seed(0)
    model = torchvision.models.resnet50().cuda().train()
    x = torch.randn(batch, 3, 224, 224, device="cuda")
    y = torch.randint(0, 1000, (batch,), device="cuda")
    loss_fn = torch.nn.CrossEntropyLoss()

    def step_of(forward: Callable[[torch.Tensor], Any], autocast: bool = False
                ) -> Callable[[], None]:
        def step() -> None:
            with torch.autocast("cuda", torch.bfloat16, enabled=autocast):
                out = forward(x)
            loss_fn(out.float(), y).backward()
        return step

    runners = {"eager fp32": step_of(model), "autocast bf16": step_of(model, autocast=True)}
    notes = []
    for label, options in (("autoopt fp32", {}), ("autoopt bf16", {"precision": "bf16"})):
        try:
            fast = autoopt.optimize(model, (x,), training=True, **options)
        except Exception as exc:  # noqa: BLE001 - a row that says why, not a crash
            notes.append(f"{label}: {type(exc).__name__}: {exc}")
            continue
        runners[label] = step_of(fast)
        precision = fast.report.captures[0].precision
        if precision is not None:
            notes.append(f"{label}: {precision.lines()[0]}")
    times: dict[str, list[float]] = {label: [] for label in runners}
    for run in runners.values():  # warm-up: cuDNN picks its algorithms
        run()
        run()
    for _ in range(rounds):
        for label, run in runners.items():
            torch.cuda.synchronize()
            start = time.perf_counter()
            run()
            torch.cuda.synchronize()
            times[label].append(time.perf_counter() - start)
    eager = statistics.median(times["eager fp32"])
    rows = [f"## Training precision (CUDA, {torch.cuda.get_device_name()})", "",
            f"`python bench/training_precision.py --batch {batch} --rounds {rounds}`: resnet50 "
            f"training step at batch {batch}, median of {rounds} interleaved rounds.", "",
            "| run | step | vs eager fp32 |", "|---|---|---|"]
    for label, samples in times.items():
        median = statistics.median(samples)
        rows.append(f"| {label} | {median * 1e3:.1f} ms | {eager / median:.2f}x |")
    return rows + [""] + notes


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=10)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU (torch.cuda.is_available() is False)", file=sys.stderr)
        return 2
    print("\n".join(gpu_rows(args.batch, args.rounds)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
