"""Inference latency: eager vs autoopt.optimize vs torch.compile vs ONNX Runtime, same run.

    python bench/inference.py [--threads 1] [--batches 1,8] [--models resnet50,gpt2]
                              [--device cuda] [--write] [--out table.md]

Models have random weights at full size (images 224×224, text 128 tokens). For each model and
batch the runners are timed round-robin (interleaved, so drift of this shared machine hits
all alike) and the median per runner is kept. Reported: median latency, speedup over eager,
optimize/compile/export time, the memory autoopt and torch.compile hold after preparing, the
max abs error against eager, and autoopt's ONNX file against plain export's under ORT as the
median of back-to-back round ratios. ``--write`` updates docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import copy
import ctypes
import gc
import platform
import resource
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

import autoopt

transformers.logging.set_verbosity_error()
sys.path.insert(0, str(Path(__file__).resolve().parent))
from cost_model_accuracy import publish  # noqa: E402

Inputs = tuple[tuple[Any, ...], dict[str, Any]]


def _image(factory: Callable[[], nn.Module]) -> Callable[[int], tuple[nn.Module, Inputs]]:
    return lambda b: (factory().eval(), ((torch.randn(b, 3, 224, 224),), {}))


def _text(config: Any, cls: type, **kw: Any) -> Callable[[int], tuple[nn.Module, Inputs]]:
    return lambda b: (cls(config).eval(), ((torch.randint(0, 1000, (b, 128)),), dict(kw)))


MODELS = {
    "resnet50": _image(torchvision.models.resnet50),
    "mobilenet_v3_large": _image(torchvision.models.mobilenet_v3_large),
    "vit_b_16": _image(torchvision.models.vit_b_16),
    "bert-base": _text(transformers.BertConfig(), transformers.BertModel),
    "gpt2": _text(transformers.GPT2Config(), transformers.GPT2Model, use_cache=False),
}


def _rss_mib() -> float:
    """Resident memory now (not the peak): before and after preparing a runner, the growth is
    what the runner holds (packed weights, compiled code, ORT's copy of the weights, the
    libraries' kernel caches). Freed heap is handed back to the system first, or memory a
    runner used only while preparing would count as held."""
    gc.collect()
    if sys.platform.startswith("linux"):
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * resource.getpagesize() / 2**20


def _first_tensor(out: Any) -> torch.Tensor:
    if isinstance(out, torch.Tensor):
        return out
    if hasattr(out, "last_hidden_state"):
        return out.last_hidden_state
    if isinstance(out, (list, tuple)):
        return _first_tensor(out[0])
    raise TypeError(type(out))


def _export_plain(model: nn.Module, args: tuple, kwargs: dict, path: str) -> None:
    torch.onnx.export(model, args, path, kwargs=kwargs or None, dynamo=True)


def _ort_runner(path: str, args: tuple, device: torch.device, plain: bool) -> Callable[[], Any]:
    """A call of an ONNX Runtime session on ``path``: plain ORT (CPU EP, all graph
    optimizations, numpy in and out) for the plain export, ``autoopt.onnx_session`` for
    autoopt's; on CUDA both go through ``autoopt.onnx_session`` (CUDA EP, IO binding)."""
    import onnxruntime as ort

    tensors = tuple(a for a in args if isinstance(a, torch.Tensor))
    if device.type == "cuda" or not plain:
        session = autoopt.onnx_session(path, device=device, threads=torch.get_num_threads())
        return lambda: _first_tensor(session(*tensors))
    options = ort.SessionOptions()
    options.intra_op_num_threads = torch.get_num_threads()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    plain_session = ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])
    names = [i.name for i in plain_session.get_inputs()]
    feed = dict(zip(names, [a.numpy() for a in tensors], strict=False))
    return lambda: torch.from_numpy(plain_session.run(None, feed)[0])


def _synchronized(run: Callable[[], Any], device: torch.device) -> Callable[[], Any]:
    """``run`` timed to the end of its device work (CUDA calls return before it)."""
    if device.type != "cuda":
        return run

    def timed() -> Any:
        out = run()
        torch.cuda.synchronize(device)
        return out

    return timed


def bench_one(name: str, batch: int, rounds: int, device: str = "cpu") -> dict[str, Any]:
    torch.manual_seed(0)
    model, (args, kwargs) = MODELS[name](batch)
    target = torch.device(device)
    model = model.to(target)
    args = tuple(a.to(target) if isinstance(a, torch.Tensor) else a for a in args)
    runners: dict[str, Callable[[], Any]] = {}
    prepare: dict[str, float] = {}
    memory: dict[str, float] = {}
    failures: dict[str, str] = {}  # runner -> why it has no time (shown in its cell)
    with torch.no_grad():
        runners["eager"] = lambda: model(*args, **kwargs)
        own_copy = copy.deepcopy(model)  # torch.compile's, made outside its time and memory
        for label, build in (
            ("autoopt", lambda: autoopt.optimize(model, args, kwargs)),
            ("torch.compile", lambda: torch.compile(own_copy)),
        ):
            before, start = _rss_mib(), time.perf_counter()
            built = build()
            built(*args, **kwargs)  # torch.compile compiles on the first call
            prepare[label] = time.perf_counter() - start
            memory[label] = _rss_mib() - before
            runners[label] = lambda built=built: built(*args, **kwargs)
        with tempfile.TemporaryDirectory() as tmp:
            paths = {"onnxruntime": str(Path(tmp) / "model.onnx"),
                     "autoopt→onnxruntime": str(Path(tmp) / "autoopt.onnx")}
            exports = {
                "onnxruntime": lambda: _export_plain(model, args, kwargs, paths["onnxruntime"]),
                "autoopt→onnxruntime": lambda: autoopt.export_onnx(
                    model, args, paths["autoopt→onnxruntime"], example_kwargs=kwargs,
                    verify=False),
            }

            def open_session(label: str) -> Callable[[], Any]:
                return _ort_runner(paths[label], args, target, plain=label == "onnxruntime")

            for label, export in exports.items():
                try:
                    before, start = _rss_mib(), time.perf_counter()
                    export()
                    runners[label] = open_session(label)
                    runners[label]()
                    prepare[label] = time.perf_counter() - start
                    memory[label] = _rss_mib() - before
                except Exception as exc:  # noqa: BLE001 - a failure is a row entry, not a crash
                    failures[label] = _reason(exc)
                    print(f"  {label} failed on {name}: {type(exc).__name__}: {exc}",
                          file=sys.stderr)
            reference = _first_tensor(runners["eager"]())
            errors = {k: float((_first_tensor(r()) - reference).abs().max())
                      for k, r in runners.items()}
            times: dict[str, list[float]] = {k: [] for k in runners}
            for half in range(2):
                if half == 1:
                    # In one process the ORT session created first runs a few percent faster
                    # (measured both ways on identical graphs): the second half of the rounds
                    # runs on sessions created again in the other order.
                    ort_labels = [k for k in reversed(list(paths)) if k in runners]
                    for label in ort_labels:
                        del runners[label]
                    gc.collect()
                    for label in ort_labels:
                        runners[label] = open_session(label)
                        runners[label]()
                timed_runners = {k: _synchronized(r, target) for k, r in runners.items()}
                for _ in range((rounds + 1 - half) // 2):
                    for label, run in timed_runners.items():
                        start = time.perf_counter()
                        run()
                        times[label].append(time.perf_counter() - start)
    median = {k: statistics.median(v) for k, v in times.items()}
    # autoopt's ONNX file against plain export's, round by round: the two run back to back, so
    # the median of their ratios is steadier on a drifting machine than a ratio of medians.
    ort_ratio = None
    if "autoopt→onnxruntime" in times and "onnxruntime" in times:
        ort_ratio = statistics.median(a / b for a, b in zip(
            times["autoopt→onnxruntime"], times["onnxruntime"], strict=True))
    return {"model": name, "batch": batch, "median": median, "prepare": prepare,
            "memory": memory, "errors": errors, "failures": failures, "ort_ratio": ort_ratio}


def _warm_up(device: str) -> None:
    """One optimize and one compile of a small model, so that the libraries' one-time set-up
    (imports, export and Dynamo state) is not charged to the first row's times and memory."""
    small = nn.Sequential(nn.Linear(8, 8), nn.ReLU()).eval().to(device)
    x = torch.randn(2, 8, device=device)
    with torch.no_grad():
        autoopt.optimize(small, (x,))(x)
        torch.compile(copy.deepcopy(small))(x)


def _reason(exc: Exception) -> str:
    """An exception's first line, short enough for a table cell."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    return f"{text[:77]}..." if len(text) > 80 else text


def table(rows: list[dict[str, Any]], threads: int, command: str, device: str = "cpu") -> str:
    if torch.device(device).type == "cuda":
        title = "## Inference latency (CUDA)"
        machine = f"{torch.cuda.get_device_name(torch.device(device))}, CUDA {torch.version.cuda}"
    else:
        title = "## Inference latency (CPU)"
        machine = f"{platform.processor() or platform.machine()}, {threads} thread(s)"
    lines = [title, "", f"Command: `{command}`  ",
             f"Machine: {machine}, "
             f"torch {torch.__version__}. Random weights, images 224×224, text 128 tokens. "
             "Median of interleaved rounds; speedup = eager median / runner median; prepare = "
             "optimize / compile (incl. first call) / export + session time; held = resident "
             "memory growth from preparing (autoopt / torch.compile; the model's own weights "
             "not counted); err = max abs difference from eager; autoopt→ORT ÷ ORT = "
             "median over rounds of autoopt's ONNX file's time over plain export's, run back to "
             "back (below 1: autoopt's export is faster under ORT).", "",
             "| model | batch | eager ms | autoopt | torch.compile | onnxruntime | autoopt→"
             "onnxruntime | autoopt→ORT ÷ ORT | autoopt prepare s | compile s | held MiB | "
             "autoopt err |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    speedups = []
    for r in rows:
        m, p = r["median"], r["prepare"]
        eager = m["eager"]
        why = r.get("failures", {})
        cell = {label: f"{m[label] * 1e3:.1f} ms ({eager / m[label]:.2f}×)" if label in m
                else f"failed: {why.get(label, '?')}"
                for label in ("autoopt", "torch.compile", "onnxruntime", "autoopt→onnxruntime")}
        speedups.append(eager / m["autoopt"])
        lines.append(f"| {r['model']} | {r['batch']} | {eager * 1e3:.1f} | {cell['autoopt']} | "
                     f"{cell['torch.compile']} | {cell['onnxruntime']} | "
                     f"{cell['autoopt→onnxruntime']} | "
                     f"{'—' if r.get('ort_ratio') is None else format(r['ort_ratio'], '.3f')} | "
                     f"{p['autoopt']:.1f} | {p['torch.compile']:.1f} | "
                     f"{r['memory']['autoopt']:.0f} / {r['memory']['torch.compile']:.0f} | "
                     f"{r['errors']['autoopt']:.1e} |")
    geo = statistics.geometric_mean(speedups) if speedups else 0.0
    lines += ["", f"Geometric-mean autoopt speedup over eager: {geo:.2f}×."]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    parser.add_argument("--write", action="store_true", help="update docs/benchmarks.md")
    parser.add_argument("--out", type=Path, help="also write the table to this file")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    _warm_up(args.device)
    rows = []
    for name in args.models.split(","):
        for batch in (int(b) for b in args.batches.split(",")):
            row = bench_one(name, batch, args.rounds, args.device)
            rows.append(row)
            print(f"{name} b{batch}: " + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in
                                                   row["median"].items()), flush=True)
    section = table(rows, args.threads, "python bench/inference.py " + " ".join(sys.argv[1:]),
                    args.device)
    publish(section, write=args.write, out=args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
