"""The project's one GPU check: everything that needs a CUDA device, in one command.

    python bench/gpu_check.py --out "$OUT"

Runs the tests marked ``gpu`` and records the device; writes ``gpu_check.md`` (a summary),
``pytest-gpu.xml`` (JUnit) and ``device.json`` under ``--out``. Exits non-zero if a GPU test
fails or no GPU is present. Later issues add their GPU checks here (CUDA cost model,
fp16/bf16, offloading, the inference benchmark) so one call covers them all.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent


def device_facts() -> dict[str, object]:
    facts: dict[str, object] = {"torch": torch.__version__, "cuda": torch.version.cuda,
                                "available": torch.cuda.is_available()}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        facts.update(name=props.name, memory_gib=round(props.total_memory / 2**30, 1),
                     sm_count=props.multi_processor_count,
                     capability=f"{props.major}.{props.minor}",
                     device_count=torch.cuda.device_count())
    return facts


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for the results")
    parser.add_argument("--timeout", type=int, default=420, help="seconds for the tests")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    facts = device_facts()
    (args.out / "device.json").write_text(json.dumps(facts, indent=2))
    if not facts["available"]:
        print("no CUDA GPU: nothing to check", file=sys.stderr)
        return 2
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p",
                           "no:cacheprovider", f"--junitxml={args.out / 'pytest-gpu.xml'}",
                           str(ROOT / "tests")], capture_output=True, text=True,
                          timeout=args.timeout, cwd=ROOT)
    seconds = time.perf_counter() - start
    tail = "\n".join(done.stdout.strip().splitlines()[-15:])
    summary = [f"# GPU check ({facts.get('name')}, torch {facts['torch']})", "",
               f"`python bench/gpu_check.py --out OUT`: gpu tests exit code {done.returncode} "
               f"in {seconds:.0f} s", "", "```", tail, "```"]
    (args.out / "gpu_check.md").write_text("\n".join(summary) + "\n")
    print("\n".join(summary))
    return done.returncode


if __name__ == "__main__":
    sys.exit(main())
