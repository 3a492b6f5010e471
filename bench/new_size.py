"""A new input size after optimize: the README's Quick start (resnet18, optimized at batch 1,
then called at batch 4), timed from cold caches in a fresh process.

    python bench/new_size.py [--threads 2] [--runs 1] [--write] [--out table.md]

Each run is a child process with an empty autoopt cache and an empty Inductor cache: what a new
user's first session costs. Reported: ``optimize`` (the first call included), the first call
at the new size, their ratio, the backend each graph runs and whether the second graph measured
its candidates or built the first graph's winner alone (issue 47, item 3: at most 0.25).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cost_model_accuracy import heading, publish  # noqa: E402

CHILD = """
import json, sys, time, torch, torchvision
import autoopt
torch.set_num_threads(int(sys.argv[1]))
model = torchvision.models.resnet18().eval()
x = torch.randn(1, 3, 64, 64)
start = time.perf_counter()
fast = autoopt.optimize(model, (x,))
with torch.no_grad():
    fast(x)
    optimize_s = time.perf_counter() - start
    start = time.perf_counter()
    y = fast(torch.randn(4, 3, 64, 64))
    new_s = time.perf_counter() - start
first, second = (c.backends[0] for c in fast.report.captures[:2])
print(json.dumps({"optimize_s": optimize_s, "new_s": new_s, "first": first.chosen,
                  "second": second.chosen, "measured": sorted(second.seconds),
                  "shared": first.shared}))
"""


def run(threads: int) -> dict[str, object]:
    load = os.getloadavg()[0]  # what else the machine ran as this run began
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "XDG_CACHE_HOME": f"{tmp}/xdg",
               "TORCHINDUCTOR_CACHE_DIR": f"{tmp}/inductor", "AUTOOPT_PROGRESS": "0"}
        env.pop("AUTOOPT_BACKENDS", None)
        done = subprocess.run([sys.executable, "-c", CHILD, str(threads)], env=env,
                              capture_output=True, text=True, check=True)
    return {**json.loads(done.stdout.strip().splitlines()[-1]), "load": load}


def table(rows: list[dict[str, object]], threads: int, command: str) -> str:
    title, machine = heading("A new input size after optimize", torch.device("cpu"))
    lines = [title, "", f"`{command}` — {machine}, {threads} thread(s), torch "
             f"{torch.__version__}, Python {platform.python_version()}. Each run: a fresh "
             "process, empty autoopt and Inductor caches; resnet18 optimized at 1×3×64×64 "
             "(the first call included), then called at 4×3×64×64.", "",
             "| run | load (1 min) | optimize s | first call at batch 4 s | ratio | first graph "
             "| new size | new size measured |", "|---|---|---|---|---|---|---|---|"]
    for i, r in enumerate(rows, 1):
        ratio = float(r["new_s"]) / float(r["optimize_s"])
        measured = ", ".join(r["measured"]) or "nothing (the first graph's winner alone)"
        shared = " (first choice measured on a shared CPU: not reused)" if r["shared"] else ""
        lines.append(f"| {i} | {r['load']:.2f} | {r['optimize_s']:.1f} | {r['new_s']:.2f} | "
                     f"{ratio:.2f} | {r['first']}{shared} | {r['second']} | {measured} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--write", action="store_true", help="update docs/benchmarks.md")
    parser.add_argument("--out", type=Path, help="also write the table to this file")
    args = parser.parse_args()
    rows = []
    for i in range(args.runs):
        print(f"new_size: run {i + 1} of {args.runs} (a fresh process, cold caches)",
              file=sys.stderr, flush=True)
        rows.append(run(args.threads))
    command = "python bench/new_size.py " + " ".join(sys.argv[1:])
    publish(table(rows, args.threads, command.strip()), write=args.write, out=args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
