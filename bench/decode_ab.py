"""autoopt against llama.cpp at the same bits, one precision at a time, interleaved.

``bench/generate.py`` loads llama.cpp's four files into its process beside every torch runner;
at 2 threads that slowed the torch runners 1.2-1.6x (llama.cpp's thread pools). Here each
precision has only its own GGUF file loaded while it is timed, and the two runners alternate
round by round. Decode time a token = (a call of 1 + new tokens less a call of 1) / new, so
the prompt step is not counted; medians of the rounds.

    python bench/decode_ab.py --threads 2 --models llama,gpt2
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import generate  # noqa: E402 - the bench's models
import gguf_file  # noqa: E402
from cost_model_accuracy import heading  # noqa: E402

import autoopt  # noqa: E402

KINDS = {"fp32": "f32", "bf16": "f16", "int8": "Q8_0", "int4": "Q4_0"}


def decode_ms(call: Callable[[int], Any], new: int) -> float:
    start = time.perf_counter()
    call(1)
    one = time.perf_counter() - start
    start = time.perf_counter()
    call(1 + new)
    return (time.perf_counter() - start - one) / new * 1e3


def run(name: str, precisions: list[str], threads: int, new: int, rounds: int,
        folder: Path) -> list[str]:
    torch.manual_seed(0)
    model = generate.MODELS[name]()
    ids = torch.randint(1, model.config.vocab_size, (1, 32))
    cells = []
    for precision in precisions:
        print(f"[{name}] {precision}: optimize, and llama.cpp {KINDS[precision]}", flush=True)
        try:
            fast = autoopt.optimize(model, (ids,), precision=None if precision == "fp32" else
                                    precision, pass_options={"precision": {"min_agreement": 0.0}})
        except autoopt.ConfigError as exc:  # no kernel of that precision faster than fp32
            print(f"[{name}] {precision}: {exc}", flush=True)
            cells.append("refused (no faster kernel)")
            continue

        def ours(n: int, fast: Any = fast) -> Any:
            return fast.generate(ids, max_new_tokens=n, do_sample=False, eos_token_id=None)

        path = gguf_file.write(model, folder / f"{name}-{precision}.gguf", KINDS[precision])
        runner = gguf_file.Runner(path, threads, ids.shape[1] + new + 8)

        def theirs(n: int, runner: Any = runner) -> Any:
            return runner.generate(ids, n)

        try:
            ours(8), ours(8)  # the step graphs measure their own linears, and may refuse
        except autoopt.ConfigError as exc:
            print(f"[{name}] {precision}: {exc}", flush=True)
            cells.append("refused (no faster kernel)")
            continue
        theirs(8)
        times: dict[str, list[float]] = {"autoopt": [], "llama.cpp": []}
        for _ in range(rounds):
            times["autoopt"].append(decode_ms(ours, new))
            times["llama.cpp"].append(decode_ms(theirs, new))
        a, b = (statistics.median(times[k]) for k in ("autoopt", "llama.cpp"))
        if min(a, b) <= 0:  # a model so small that the calls' jitter exceeds its decode steps
            cells.append("not timed: a longer call was no slower than a 1-token call")
        else:
            cells.append(f"{1e3 / a:.1f} / {1e3 / b:.1f} ({b / a:.2f}×)")
        print(f"[{name}] {precision}: autoopt {a:.2f} ms, llama.cpp {b:.2f} ms a token",
              flush=True)
        del fast, runner, ours, theirs
        gc.collect()
    return cells


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--models", default="llama,gpt2")
    parser.add_argument("--precisions", default=",".join(KINDS))
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    why = gguf_file.available()
    if why:
        print(f"skipped: {why}")
        return 0
    torch.set_num_threads(args.threads)
    precisions = args.precisions.split(",")
    # Load: the 1-minute load average when the model's rounds ended (about the thread count
    # alone; more: other jobs shared the cores, and the row is not a quiet machine's).
    lines = ["| model | " + " | ".join(f"autoopt {p} / llama.cpp {KINDS[p]} tok/s"
                                       for p in precisions) + " | load |",
             "|---|" + "---|" * (len(precisions) + 1)]
    with tempfile.TemporaryDirectory(prefix="autoopt-gguf-") as folder:
        for name in args.models.split(","):
            cells = run(name, precisions, args.threads, args.new, args.rounds, Path(folder))
            lines.append(f"| {name} | " + " | ".join(cells) + f" | {os.getloadavg()[0]:.2f} |")
    print(f"\n{' '.join(sys.argv)}, {args.threads} thread(s), "
          f"{heading('', torch.device('cpu'))[1]}\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
