"""Dynamic shapes: one prepared model serving many input sizes. Eager vs
``autoopt.optimize(..., dynamic=True)`` vs ``torch.compile(dynamic=True)`` vs ONNX Runtime on an
export with dynamic axes, in one run.

    python bench/dynamic.py [--threads 1] [--models bert-base,resnet50] [--rounds 7]
                            [--write] [--out table.md]

Models have random weights at full size. Each runner is prepared once, on the model's first
size, with the varying dimension marked dynamic (BERT-base: the sequence, batch 1, prepared at
128 tokens and called at 32, 128 and 200; resnet50: the batch at 224×224, prepared at 2 and
called at 2, 4 and 8), then called at every size: after one warm-up call per size, the runners
are timed round-robin (interleaved, so drift of the machine hits all alike) and the median per
runner is kept. Reported per size: median latency and speedup over eager, autoopt over the
faster peer, autoopt's largest absolute difference from eager, and per model how long each
runner took to prepare and how many graphs autoopt holds after every size (one where the
sizes share a graph).
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torchvision
import transformers
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cost_model_accuracy import first_tensor, heading, publish  # noqa: E402

import autoopt  # noqa: E402

transformers.logging.set_verbosity_error()

# name -> (model factory, input for a size, the dynamic dimension's name and index, sizes;
# the first size is the one every runner is prepared on).
MODELS: dict[str, tuple[Callable[[], nn.Module], Callable[[int], torch.Tensor], str, int,
                        tuple[int, ...]]] = {
    "bert-base": (lambda: transformers.BertModel(transformers.BertConfig()),
                  lambda n: torch.randint(0, 1000, (1, n)), "tokens", 1, (128, 32, 200)),
    "resnet50": (torchvision.models.resnet50, lambda n: torch.randn(n, 3, 224, 224),
                 "batch", 0, (2, 4, 8)),
}


def _onnxruntime(model: nn.Module, x: torch.Tensor, dim: int) -> Callable[[torch.Tensor], Any]:
    import onnxruntime as ort

    path = Path(tempfile.mkdtemp()) / "model.onnx"
    torch.onnx.export(model, (x,), str(path), dynamo=True,
                      dynamic_shapes=({dim: torch.export.Dim("size", min=2, max=4096)},))
    options = ort.SessionOptions()
    options.intra_op_num_threads = torch.get_num_threads()
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    name = session.get_inputs()[0].name
    return lambda t: torch.from_numpy(session.run(None, {name: t.numpy()})[0])


def _reason(exc: Exception) -> str:
    return f"{type(exc).__name__}: {' '.join(str(exc).split())[:90]}"


def bench_model(name: str, rounds: int) -> dict[str, Any]:
    factory, make, what, dim, sizes = MODELS[name]
    torch.manual_seed(0)
    model = factory().eval()
    example = make(sizes[0])
    prepared: dict[str, Callable[[torch.Tensor], Any]] = {"eager": model}
    prepare_s: dict[str, float] = {}
    failed: dict[str, str] = {}
    fast = None
    builders: dict[str, Callable[[], Callable[[torch.Tensor], Any]]] = {
        "autoopt": lambda: autoopt.optimize(model, (example,), dynamic=True),
        "torch.compile": lambda: torch.compile(model, dynamic=True),
        "onnxruntime": lambda: _onnxruntime(model, example, dim),
    }
    with torch.no_grad():
        for label, build in builders.items():
            print(f"[{name}] preparing {label}", flush=True)
            start = time.perf_counter()
            try:
                runner = build()
                runner(example)  # torch.compile compiles here
            except Exception as exc:  # noqa: BLE001 - a runner that fails is a cell that says so
                failed[label] = _reason(exc)
                print(f"[{name}] {label} failed: {failed[label]}", flush=True)
                continue
            prepare_s[label] = time.perf_counter() - start
            prepared[label] = runner
            if label == "autoopt":
                fast = runner
        rows = []
        for size in sizes:
            x = make(size)
            reference = first_tensor(model(x))
            errors = {}
            for label, runner in list(prepared.items()):
                try:
                    errors[label] = float((first_tensor(runner(x)) - reference).abs().max())
                except Exception as exc:  # noqa: BLE001
                    failed[label] = _reason(exc)
                    del prepared[label]
            print(f"[{name}] {what} {size}: timing {rounds} interleaved round(s)", flush=True)
            times: dict[str, list[float]] = {label: [] for label in prepared}
            for _ in range(rounds):
                for label, runner in prepared.items():
                    start = time.perf_counter()
                    runner(x)
                    times[label].append(time.perf_counter() - start)
            rows.append(dict(size=size, ms={k: statistics.median(v) * 1e3
                                            for k, v in times.items()}, errors=errors))
    graphs = len(fast.specializations) if fast is not None else None
    backends = sorted({c.chosen for r in fast.report.captures for c in r.backends}) \
        if fast is not None else []
    return dict(model=name, what=what, rows=rows, prepare_s=prepare_s, failed=failed,
                graphs=graphs, backends=backends)


def table(results: list[dict[str, Any]], threads: int, command: str) -> str:
    title, machine = heading("Dynamic shapes", torch.device("cpu"))
    lines = [title, "", f"`{command}` — {machine}, {threads} thread(s), torch "
             f"{torch.__version__}, transformers {transformers.__version__}, Python "
             f"{platform.python_version()}. Each runner prepared once on the first size with "
             f"that dimension dynamic, then called at every size; medians of interleaved "
             f"rounds. err = autoopt's max abs difference from eager.", "",
             "| model | size | eager ms | autoopt | torch.compile | onnxruntime | "
             "autoopt ÷ best peer | err |", "|---|---|---|---|---|---|---|---|"]
    notes = []
    for r in results:
        for row in r["rows"]:
            ms = row["ms"]
            eager = ms["eager"]
            cells = {label: f"{ms[label]:.1f} ms ({eager / ms[label]:.2f}×)" if label in ms
                     else "failed" if label in r["failed"] else "-"
                     for label in ("autoopt", "torch.compile", "onnxruntime")}
            peers = [ms[p] for p in ("torch.compile", "onnxruntime") if p in ms]
            ratio = f"{min(peers) / ms['autoopt']:.2f}×" if peers and "autoopt" in ms else "-"
            err = row["errors"].get("autoopt")
            lines.append(f"| {r['model']} | {r['what']} {row['size']} | {eager:.1f} | "
                         f"{cells['autoopt']} | {cells['torch.compile']} | "
                         f"{cells['onnxruntime']} | {ratio} | "
                         f"{'-' if err is None else f'{err:.1e}'} |")
        prep = ", ".join(f"{k} {v:.1f} s" for k, v in r["prepare_s"].items())
        notes.append(f"- {r['model']}: prepared in {prep}; autoopt holds {r['graphs']} "
                     f"graph(s) after every size (backend {', '.join(r['backends']) or '-'})"
                     + "".join(f"; {k} failed: {v}" for k, v in r["failed"].items()) + ".")
    return "\n".join(lines) + "\n\n" + "\n".join(notes) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--write", action="store_true", help="update docs/benchmarks.md")
    parser.add_argument("--out", type=Path, help="also write the table to this file")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    results = [bench_model(name, args.rounds) for name in args.models.split(",")]
    command = "python bench/dynamic.py " + " ".join(sys.argv[1:])
    publish(table(results, args.threads, command.strip()), write=args.write, out=args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
