"""Diagnosis and prefetch on the CPU: what ``autoopt.diagnose`` names for two workloads built
to have one cause each, and what ``autoopt.data.prefetch`` gains on an input-bound loop.

    python bench/diagnose.py --rounds 5

Prints a markdown section for docs/benchmarks.md. One intra-op thread; medians over rounds;
the prefetch comparison alternates plain and prefetched passes in each round.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch
import torchvision
from torch import nn
from torch.utils.data import DataLoader, Dataset

import autoopt
from autoopt.runtime.prefetch import prefetch


class SlowImages(Dataset):
    """``delay_s`` per 32×32 image: a decoding/augmentation cost on the loader's thread."""

    def __init__(self, n: int, delay_s: float) -> None:
        self.n, self.delay_s = n, delay_s

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        time.sleep(self.delay_s)
        return torch.randn(3, 32, 32), i % 10


class ManySmallOps(nn.Module):
    """Batch 1, width 16: 8 blocks of linear, tanh, scale, residual add, centering."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x)) * 0.5 + x
            x = x - x.mean()
        return x


def train_pass(model: nn.Module, batches: object, opt: torch.optim.Optimizer) -> float:
    start = time.perf_counter()
    for x, y in batches:  # type: ignore[attr-defined]
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    rows = []

    resnet = torchvision.models.resnet18(num_classes=10)
    loader = DataLoader(SlowImages(64, 0.01), batch_size=8)
    d = autoopt.diagnose(resnet.eval(), loader, steps=6)
    rows.append(("resnet18, 32×32, batch 8, loader sleeps 10 ms per image (inference)", d))
    d = autoopt.diagnose(ManySmallOps().eval(), torch.randn(1, 16), steps=50)
    rows.append(("8 blocks of 5 tiny ops, width 16, batch 1 (inference)", d))

    resnet.train()
    opt = torch.optim.SGD(resnet.parameters(), lr=1e-3)
    plain, fetched = [], []
    train_pass(resnet, loader, opt)  # warm-up
    for _ in range(args.rounds):
        plain.append(train_pass(resnet, loader, opt))
        fetched.append(train_pass(resnet, prefetch(loader, "cpu", depth=2), opt))
    steps = len(loader)

    print("## Diagnosis and prefetch (CPU)\n")
    print(f"Command: `python bench/diagnose.py --rounds {args.rounds}`  ")
    print(f"Machine: {platform.machine()}, 1 thread, torch {torch.__version__}; random "
          "weights. Shares are of median step time; the top cause is the highest-ranked "
          "finding.\n")
    print("| workload | step ms | data | memory | operators | parallelism | top cause |")
    print("|---|---|---|---|---|---|---|")
    for name, d in rows:
        s = d.shares
        top = f"{d.top.cause} ({d.top.share:.0%})" if d.top else "-"
        print(f"| {name} | {d.step.total_s * 1e3:.2f} | {s['data']:.0%} | {s['memory']:.0%} "
              f"| {s['operators']:.0%} | {s['parallelism']:.0%} | {top} |")
    p, f = statistics.median(plain), statistics.median(fetched)
    print(f"\nTraining resnet18 (32×32, batch 8, SGD) on the same slow loader, {steps} steps "
          f"per pass, median of {args.rounds} interleaved rounds: plain "
          f"{p / steps * 1e3:.1f} ms/step, `prefetch(loader, 'cpu', depth=2)` "
          f"{f / steps * 1e3:.1f} ms/step ({p / f:.2f}×): the loader's sleep overlaps the "
          "compute (a loader that holds the GIL gains less; use `num_workers` there).")


if __name__ == "__main__":
    main()
