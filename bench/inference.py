"""Inference latency: eager vs autoopt.optimize vs torch.compile vs ONNX Runtime, same run.

    python bench/inference.py [--threads 1,2] [--batches 1,8] [--models resnet50,gpt2]
                              [--rounds 15] [--device cuda] [--skip RUNNERS]
                              [--optimize-times | --no-optimize-times] [--write] [--out table.md]
    python bench/inference.py --call-overhead [--models ...] [--batches 1] [--threads 1]
    python bench/inference.py --static-int8 [bench/static_int8.py's options]

Models have random weights at full size (images 224×224, text 128 tokens). For each model and
batch the runners (eager, autoopt, torch.compile, torch.compile with freezing on the CPU or
``mode="max-autotune"`` on CUDA, ONNX Runtime on plain export's file and on autoopt's) are
timed round-robin (interleaved, so drift of this shared machine hits all alike) and the median
per runner is kept. Reported: median latency, speedup over eager, autoopt's speedup over the
fastest peer (torch.compile either way, ONNX Runtime), the backend autoopt chose with each
candidate's measured time, the fraction of the fp32 GEMM peak each achieves (FLOPs of one
eager forward over the latency), optimize time in a fresh process cold and again with
autoopt's cache warm, optimize/compile/export time, the memory autoopt and torch.compile hold
after preparing, the max abs error against eager, and autoopt's ONNX file against plain
export's under ORT as the median of back-to-back round ratios. ``--threads 1,2`` runs the whole
table per thread count. ``--write`` updates docs/benchmarks.md (and turns on
``--optimize-times``, which runs autoopt.optimize twice more per row in child processes).
``--call-overhead`` prints instead what each call of the optimized module spends on checking
the model's state and the inputs, next to its graph's run: with the caches as a real run
leaves them (the graph's run replaced by a sweep over twice the last-level cache, the sweep's
own time, taken in alternation, subtracted) and warm (the run replaced by a no-op, which reads
the checks several times too cheap for a model whose run outgrows the cache).
"""

from __future__ import annotations

import argparse
import copy
import ctypes
import gc
import os
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
from torch.utils.flop_counter import FlopCounterMode

import autoopt
from autoopt.backends import openvino as openvino_backend

transformers.logging.set_verbosity_error()
sys.path.insert(0, str(Path(__file__).resolve().parent))
import child_process  # noqa: E402
from cost_model_accuracy import first_tensor, publish  # noqa: E402

Inputs = tuple[tuple[Any, ...], dict[str, Any]]
# Peers autoopt is measured against in the best-of column (autoopt's own ONNX file is not one).
PEERS = ("torch.compile", "compile+freezing", "compile max-autotune", "onnxruntime",
         "openvino")
ORT_LABELS = ("onnxruntime", "autoopt→onnxruntime")
# Reduced precision, each engine's own way (CPU): OpenVINO at its default inference precision
# (bf16 where the CPU has it), torch.compile under bf16 autocast, autoopt with precision="bf16".
BF16_PEERS = ("openvino default", "compile+bf16 autocast")
BF16_LABELS = (*BF16_PEERS, "autoopt bf16")


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
        return lambda: first_tensor(session(*tensors))
    options = ort.SessionOptions()
    options.intra_op_num_threads = torch.get_num_threads()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    plain_session = ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])
    names = [i.name for i in plain_session.get_inputs()]
    feed = dict(zip(names, [a.numpy() for a in tensors], strict=False))
    return lambda: torch.from_numpy(plain_session.run(None, feed)[0])


def _autocast(compiled: Callable[..., Any]) -> Callable[..., Any]:
    def call(*args: Any, **kwargs: Any) -> Any:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return compiled(*args, **kwargs)
    return call


def _openvino_builds(model: nn.Module, args: tuple, kwargs: dict, skip: frozenset[str],
                     ) -> dict[str, Callable[[], Callable[..., Any]]]:
    """OpenVINO as its users run a PyTorch model: ``openvino.convert_model`` on the module
    with the example inputs, compiled for the CPU with torch's thread count and a latency
    hint, in f32 (``openvino``) and at its default inference precision (``openvino
    default``: bf16 where the CPU has it). Empty where OpenVINO is not installed."""
    try:
        import openvino as ov
    except ImportError:
        return {}
    converted: list[Any] = []
    tensors = [a for a in args if isinstance(a, torch.Tensor)]

    class Bound(nn.Module):  # the model's first output, its keyword settings bound
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
            return first_tensor(self.model(*inputs, **kwargs))

    def build(hint: str | None) -> Callable[..., Any]:
        if not converted:
            with torch.no_grad():
                converted.append(ov.convert_model(Bound().eval(), example_input=tuple(tensors)))
        config: dict[str, Any] = {"INFERENCE_NUM_THREADS": torch.get_num_threads(),
                                  "PERFORMANCE_HINT": "LATENCY"}
        if hint:
            config["INFERENCE_PRECISION_HINT"] = hint
        # autoopt's Core: one per process (a Core per model can crash it, see core()).
        compiled = openvino_backend.core().compile_model(converted[0], "CPU", config)
        request = compiled.create_infer_request()
        arrays = [t.numpy() for t in tensors]
        return lambda *_, **__: torch.from_numpy(
            request.infer(arrays, share_inputs=True, share_outputs=False)[compiled.outputs[0]])

    builds = {"openvino": lambda: build("f32"), "openvino default": lambda: build(None)}
    return {label: fn for label, fn in builds.items() if label not in skip}


def _synchronized(run: Callable[[], Any], device: torch.device) -> Callable[[], Any]:
    """``run`` timed to the end of its device work (CUDA calls return before it)."""
    if device.type != "cuda":
        return run

    def timed() -> Any:
        out = run()
        torch.cuda.synchronize(device)
        return out

    return timed


def _build_model(name: str, batch: int, device: str) -> tuple[nn.Module, tuple, dict]:
    torch.manual_seed(0)
    model, (args, kwargs) = MODELS[name](batch)
    target = torch.device(device)
    model = model.to(target)
    args = tuple(a.to(target) if isinstance(a, torch.Tensor) else a for a in args)
    return model, args, kwargs


def _forward_flops(model: nn.Module, args: tuple, kwargs: dict) -> int:
    """FLOPs of one eager forward as ``FlopCounterMode`` counts them (matmuls, convolutions,
    attention where it has a formula; elementwise ops count 0)."""
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model(*args, **kwargs)
    return int(counter.get_total_flops())


def _compilers(device: torch.device) -> dict[str, Callable[[nn.Module], Callable[..., Any]]]:
    """The torch.compile variants, by row label: default mode everywhere; with Inductor's
    freezing (weights constant-folded, oneDNN prepacking) on the CPU; max-autotune on CUDA."""
    variants: dict[str, Callable[[nn.Module], Callable[..., Any]]] = {
        "torch.compile": lambda m: torch.compile(m)}
    if device.type == "cuda":
        variants["compile max-autotune"] = lambda m: torch.compile(m, mode="max-autotune")
    else:
        variants["compile+freezing"] = lambda m: torch.compile(m, options={"freezing": True})
    return variants


def _backend_summary(fast: Any) -> dict[str, Any]:
    """The backend(s) autoopt chose, from its report: per graph the chosen one, each measured
    candidate's seconds, the skipped ones with why, and whether the measurement was cached."""
    choices = [{"graph": c.graph, "chosen": c.chosen, "seconds": dict(c.seconds),
                "skipped": dict(c.skipped), "cached": bool(c.cached)}
               for c in fast.report.backends]
    if not choices:  # no report entries: what the first specialization runs
        specs = getattr(fast, "specializations", None) or []
        chosen = getattr(specs[0], "backend", "") if specs else ""
        choices = [{"graph": "whole graph", "chosen": chosen or "aten", "seconds": {},
                    "skipped": {}, "cached": False}]
    return {"choices": choices}


def bench_one(name: str, batch: int, rounds: int, device: str = "cpu",
              skip: frozenset[str] = frozenset()) -> dict[str, Any]:
    # Each row compiles from scratch: no Dynamo cache entries (nor "automatic dynamic" shapes
    # learned from the previous batch size) carried over from the rows before.
    torch._dynamo.reset()
    model, args, kwargs = _build_model(name, batch, device)
    target = torch.device(device)
    runners: dict[str, Callable[[], Any]] = {}
    prepare: dict[str, float] = {}
    memory: dict[str, float] = {}
    failures: dict[str, str] = {}  # runner -> why it has no time (shown in its cell)
    backends: dict[str, Any] = {}
    flops = _forward_flops(model, args, kwargs)
    with torch.no_grad():
        runners["eager"] = lambda: model(*args, **kwargs)
        builds: dict[str, Callable[[], Callable[..., Any]]] = {
            "autoopt": lambda: autoopt.optimize(model, args, kwargs)}
        if target.type == "cpu":
            builds["autoopt bf16"] = lambda: autoopt.optimize(model, args, kwargs,
                                                              precision="bf16")
            bf16_copy = copy.deepcopy(model)
            builds["compile+bf16 autocast"] = lambda: _autocast(torch.compile(bf16_copy))
        for label, compile_fn in _compilers(target).items():
            if label in skip:
                continue
            # Each variant compiles its own copy, made outside its time and memory.
            own_copy = copy.deepcopy(model)
            builds[label] = lambda compile_fn=compile_fn, own_copy=own_copy: compile_fn(own_copy)
        if target.type == "cpu" and not {"openvino", "openvino default"} <= skip:
            builds.update(_openvino_builds(model, args, kwargs, skip))
        for label, build in builds.items():
            if label in skip:
                continue
            try:
                before, start = _rss_mib(), time.perf_counter()
                built = build()
                built(*args, **kwargs)  # torch.compile compiles on the first call
                prepare[label] = time.perf_counter() - start
                memory[label] = _rss_mib() - before
            except Exception as exc:  # noqa: BLE001 - a failure is a row entry, not a crash
                failures[label] = _reason(exc)
                print(f"  {label} failed on {name}: {type(exc).__name__}: {exc}",
                      file=sys.stderr)
                continue
            runners[label] = lambda built=built: built(*args, **kwargs)
            if label == "autoopt":
                backends = _backend_summary(built)
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
                if label in skip:
                    continue
                try:
                    before, start = _rss_mib(), time.perf_counter()
                    export()
                    runners[label] = open_session(label)
                    runners[label]()
                    prepare[label] = time.perf_counter() - start
                    memory[label] = _rss_mib() - before
                except Exception as exc:  # noqa: BLE001 - a failure is a row entry, not a crash
                    runners.pop(label, None)
                    failures[label] = _reason(exc)
                    print(f"  {label} failed on {name}: {type(exc).__name__}: {exc}",
                          file=sys.stderr)
            reference = first_tensor(runners["eager"]())
            errors = {k: float((first_tensor(r()).float() - reference).abs().max())
                      for k, r in runners.items()}
            scale = float(reference.abs().max())
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
    load = os.getloadavg()[0]  # over the last minute: the timed rounds' end
    # autoopt's ONNX file against plain export's, round by round: the two run back to back, so
    # the median of their ratios is steadier on a drifting machine than a ratio of medians.
    ort_ratio = None
    if "autoopt→onnxruntime" in times and "onnxruntime" in times:
        ort_ratio = statistics.median(a / b for a, b in zip(
            times["autoopt→onnxruntime"], times["onnxruntime"], strict=True))
    return {"model": name, "batch": batch, "median": median, "prepare": prepare,
            "memory": memory, "errors": errors, "failures": failures, "ort_ratio": ort_ratio,
            "flops": flops, "backends": backends, "scale": scale, "load": load}


def optimize_once(name: str, batch: int, device: str) -> dict[str, Any]:
    """In this (fresh) process: ``autoopt.optimize`` of the model and its first call, timed
    after the imports, with which backends it chose and whether from the cache."""
    model, args, kwargs = _build_model(name, batch, device)
    with torch.no_grad():
        start = time.perf_counter()
        fast = autoopt.optimize(model, args, kwargs)
        optimized = time.perf_counter() - start
        fast(*args, **kwargs)
        if torch.device(device).type == "cuda":
            torch.cuda.synchronize()
        total = time.perf_counter() - start
    return {"optimize_s": optimized, "total_s": total, **_backend_summary(fast)}


def optimize_times(name: str, batch: int, threads: int, device: str,
                   timeout_s: float = 3600) -> dict[str, Any]:
    """``optimize_once`` in a fresh process twice in sequence, both with one fresh autoopt cache
    (``XDG_CACHE_HOME``), so the first measures every backend candidate and the second finds
    the first's measurements. Inductor's own caches are left where they are (warm by now:
    this row's in-process runs compiled the same graphs)."""
    result: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="autoopt-bench-cache-") as cache:
        env = {**os.environ, "XDG_CACHE_HOME": cache}
        for which in ("first", "second"):
            command = [sys.executable, str(Path(__file__).resolve()), "--child-optimize", name,
                       "--batches", str(batch), "--threads", str(threads), "--device", device]
            result[which] = child_process.run(command, env, timeout_s)
            if "error" in result[which]:
                print(f"  optimize in a fresh process ({which}) failed on {name}: "
                      f"{result[which]['error']}", file=sys.stderr)
                break
    return result


def gemm_peak(device: str) -> tuple[float, str]:
    """The fp32 GEMM peak at the current thread count, FLOP/s, and where it comes from: autoopt
    cost model's ceiling (a 512³ ``torch.mm``, median), or on the CPU a 1024³ GEMM best-of-10
    through oneDNN's packed linear (``torch.mm`` goes to MKL, which on some CPUs, AMD's among
    them, takes a narrower code path than oneDNN), whichever is higher."""
    from autoopt.cost_model import CostModel

    ceilings = CostModel(device).info.ceilings
    peak = ceilings.matmul_flops if ceilings is not None else 0.0
    source = "autoopt cost model's 512³ torch.mm ceiling"
    if torch.device(device).type != "cpu" or not hasattr(torch.ops.mkldnn, "_linear_pointwise"):
        return peak, source
    try:
        n = 1024
        x, w = torch.randn(n, n), torch.randn(n, n)
        packed = torch.ops.mkldnn._reorder_linear_weight(w, n)
        seconds = []
        for _ in range(12):
            start = time.perf_counter()
            torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
            seconds.append(time.perf_counter() - start)
        onednn = 2 * n**3 / min(seconds[2:])
    except (RuntimeError, AttributeError):
        return peak, source
    if onednn > peak:
        return onednn, (f"oneDNN linear 1024³, best of 10; {source}: "
                        f"{peak / 1e9:.0f} GFLOP/s")
    return peak, source


def _warm_up(device: str) -> None:
    """One optimize and one compile of a small model, so that the libraries' one-time set-up
    (imports, export and Dynamo state) is not charged to the first row's times and memory."""
    small = nn.Sequential(nn.Linear(8, 8), nn.ReLU()).eval().to(device)
    x = torch.randn(2, 8, device=device)
    with torch.no_grad():
        autoopt.optimize(small, (x,))(x)
        for compile_fn in _compilers(torch.device(device)).values():
            compile_fn(copy.deepcopy(small))(x)


def _reason(exc: Exception) -> str:
    """An exception's first line, short enough for a table cell."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    return f"{text[:77]}..." if len(text) > 80 else text


def _backend_cell(backends: dict[str, Any]) -> str:
    """``onnxruntime (aten 85.1 / inductor 80.2 / onnxruntime 70.3 ms)`` per graph, ``+``
    between graphs; ``, cached`` where the measurement came from autoopt's cache."""
    parts = []
    for c in backends.get("choices", []):
        timed = " / ".join(f"{n} {s * 1e3:.1f}" for n, s in
                           sorted(c["seconds"].items(), key=lambda item: item[1]))
        detail = [f"{timed} ms"] if timed else []
        detail += [f"{n} skipped" for n in c["skipped"]]
        if c["cached"]:
            detail.append("cached")
        parts.append(c["chosen"] + (f" ({'; '.join(detail)})" if detail else ""))
    if len(parts) > 3:  # many Dynamo subgraphs: count them by backend
        counts: dict[str, int] = {}
        for c in backends["choices"]:
            counts[c["chosen"]] = counts.get(c["chosen"], 0) + 1
        return f"{len(parts)} graphs: " + ", ".join(f"{n}×{k}" for k, n in counts.items())
    return " + ".join(parts) or "—"


def _optimize_cell(times: dict[str, Any] | None) -> str:
    if not times:
        return "—"
    cells = []
    for which in ("first", "second"):
        entry = times.get(which)
        if entry is None:
            cells.append("—")
        elif "error" in entry:
            cells.append(f"failed: {entry['error'][:60]}")
        else:
            cells.append(f"{entry['total_s']:.1f}")
    text = " / ".join(cells)
    first, second = times.get("first", {}), times.get("second", {})
    if "total_s" in first and "total_s" in second and first["total_s"] > 0:
        text += f" ({second['total_s'] / first['total_s']:.2f})"
    return text


def _best_peer(r: dict[str, Any]) -> tuple[str, float] | None:
    timed = {k: v for k, v in r["median"].items() if k in PEERS}
    if not timed:
        return None
    label = min(timed, key=timed.__getitem__)
    return label, timed[label]


def table(rows: list[dict[str, Any]], threads: int, device: str = "cpu",
          peak: tuple[float, str] = (0.0, ""), optimize_times_on: bool = False) -> str:
    """One thread count's table (a ``###`` subsection of the benchmark's section)."""
    cuda = torch.device(device).type == "cuda"
    compiled = "compile max-autotune" if cuda else "compile+freezing"
    heading = (f"### {threads} thread{'s' if threads != 1 else ''}" if not cuda else
               f"### {torch.cuda.get_device_name(torch.device(device))}")
    peak_flops, source = peak
    lines = [heading, "",
             f"fp32 GEMM peak{'' if cuda else f' at {threads} thread' + 's' * (threads != 1)}: "
             + (f"{peak_flops / 1e9:.0f} GFLOP/s ({source})." if peak_flops else "unknown."),
             "",
             "| model | batch | eager ms | autoopt | autoopt backend (candidates' ms) | "
             f"torch.compile | {compiled} | onnxruntime | autoopt→onnxruntime | "
             "autoopt ÷ best peer | GFLOP | % of peak autoopt / best peer | "
             "optimize s fresh process: first / second (ratio) | autoopt prepare s | "
             "compile s | held MiB | autoopt err | autoopt→ORT ÷ ORT | openvino | "
             "openvino default (err) | compile+bf16 autocast (err) | autoopt bf16 (err) | "
             "autoopt bf16 ÷ best bf16 peer | load |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
             "---|---|---|---|---|---|"]
    over_eager, over_peer, over_bf16 = [], [], []
    for r in rows:
        m, p = r["median"], r["prepare"]
        eager = m["eager"]
        why = r.get("failures", {})
        cell = {label: f"{m[label] * 1e3:.1f} ms ({eager / m[label]:.2f}×)" if label in m
                else ("skipped" if label not in why else f"failed: {why[label]}")
                for label in ("autoopt", "torch.compile", compiled, *ORT_LABELS)}
        peer = _best_peer(r)
        ratio, roofline = "—", "—"
        if "autoopt" in m:
            over_eager.append(eager / m["autoopt"])
            if peer is not None:
                over_peer.append(peer[1] / m["autoopt"])
                ratio = f"{peer[1] / m['autoopt']:.2f}× (vs {peer[0]})"
            if peak_flops and r["flops"]:
                roofline = f"{r['flops'] / m['autoopt'] / peak_flops:.0%}"
                if peer is not None:
                    roofline += f" / {r['flops'] / peer[1] / peak_flops:.0%}"
        for label in ("openvino", *BF16_LABELS):
            cell[label] = _cell(r, label)
        bf16_ratio = "—"
        bf16_peers = {k: m[k] for k in BF16_PEERS if k in m}
        if "autoopt bf16" in m and bf16_peers:
            best = min(bf16_peers, key=bf16_peers.__getitem__)
            over_bf16.append(bf16_peers[best] / m["autoopt bf16"])
            bf16_ratio = f"{over_bf16[-1]:.2f}× (vs {best})"
        bf16_cells = (f" {cell['openvino']} | {cell['openvino default']} | "
                      f"{cell['compile+bf16 autocast']} | {cell['autoopt bf16']} | "
                      f"{bf16_ratio} | {_load_cell(r.get('load'), threads)} |")
        held = " / ".join(f"{r['memory'][k]:.0f}" if k in r["memory"] else "—"
                          for k in ("autoopt", "torch.compile", compiled))
        compile_s = " / ".join(f"{p[k]:.1f}" if k in p else "—"
                               for k in ("torch.compile", compiled))
        lines.append(
            f"| {r['model']} | {r['batch']} | {eager * 1e3:.1f} | {cell['autoopt']} | "
            f"{_backend_cell(r.get('backends', {}))} | {cell['torch.compile']} | "
            f"{cell[compiled]} | {cell['onnxruntime']} | {cell['autoopt→onnxruntime']} | "
            f"{ratio} | {r['flops'] / 1e9:.1f} | {roofline} | "
            f"{_optimize_cell(r.get('optimize_times')) if optimize_times_on else 'not run'} | "
            f"{p['autoopt']:.1f} | {compile_s} | {held} | "
            f"{format(r['errors']['autoopt'], '.1e') if 'autoopt' in r['errors'] else '—'} | "
            f"{'—' if r.get('ort_ratio') is None else format(r['ort_ratio'], '.3f')} |"
            + bf16_cells
            if "autoopt" in p else
            f"| {r['model']} | {r['batch']} | {eager * 1e3:.1f} | {cell['autoopt']} |"
            + " |" * 14 + bf16_cells)
    lines.append("")
    if over_eager:
        lines.append(f"Geometric mean over the {len(over_eager)} rows: autoopt "
                     f"{statistics.geometric_mean(over_eager):.2f}× over eager"
                     + (f", {statistics.geometric_mean(over_peer):.3f}× over the best peer "
                        f"(target ≥ 1.05×; every row ≥ 0.97×: "
                        f"{sum(v >= 0.97 for v in over_peer)} of {len(over_peer)} rows)"
                        if over_peer else "") + ".")
    if over_bf16:
        lines.append(f"bf16: autoopt precision=\"bf16\" over the faster of OpenVINO's default "
                     f"precision and torch.compile + bf16 autocast, geometric mean over "
                     f"{len(over_bf16)} rows: {statistics.geometric_mean(over_bf16):.2f}× "
                     f"(target: ≥ 1.0× on every row: {sum(v >= 1.0 for v in over_bf16)} of "
                     f"{len(over_bf16)}).")
    return "\n".join(lines) + "\n"


def _load_cell(load: float | None, threads: int) -> str:
    """The 1-minute load average as a row's timed rounds ended, marked "shared" where other
    jobs held cores beside the bench's threads (more than half a core's worth)."""
    if load is None:
        return "—"
    return f"{load:.2f}" + (" (shared)" if load > threads + 0.5 else "")


def _cell(r: dict[str, Any], label: str) -> str:
    """A runner's time and speedup over eager, with its error against eager fp32 for a
    reduced-precision runner (relative to the output's largest magnitude)."""
    m, why = r["median"], r.get("failures", {})
    if label not in m:
        return "skipped" if label not in why else f"failed: {why[label]}"
    text = f"{m[label] * 1e3:.1f} ms ({m['eager'] / m[label]:.2f}×)"
    if label in BF16_LABELS and label in r["errors"] and r.get("scale"):
        text += f" err {r['errors'][label] / r['scale']:.1%}"
    return text


def section(tables: list[str], command: str, device: str, optimize_times_on: bool) -> str:
    """The benchmark's section of docs/benchmarks.md: the caption, then one table per thread
    count."""
    if torch.device(device).type == "cuda":
        title = "## Inference latency (CUDA)"
        machine = f"{torch.cuda.get_device_name(torch.device(device))}, CUDA {torch.version.cuda}"
        compiled = "compile max-autotune = `torch.compile(mode=\"max-autotune\")`"
    else:
        from autoopt.cost_model import device_info

        title = "## Inference latency (CPU)"
        machine = f"{device_info('cpu', measure=False).name} ({os.cpu_count()} logical CPUs)"
        compiled = ("compile+freezing = `torch.compile(options={\"freezing\": True})` under "
                    "no_grad")
    caption = [
        title, "", f"Command: `{command}`  ",
        f"Machine: {machine}, torch {torch.__version__}. Random weights, images 224×224, text "
        "128 tokens. Median of interleaved rounds; speedup = eager median / runner median; "
        f"{compiled}; autoopt ÷ best peer = the fastest of torch.compile (either variant) and "
        "ONNX Runtime on plain export's file over autoopt (above 1: autoopt is faster); "
        "autoopt backend = what autoopt's report says it chose per graph, with each verified "
        "candidate's median as autoopt measured it (a fresh autoopt cache per run, so measured "
        "in this run); GFLOP = one eager forward as `torch.utils.flop_counter.FlopCounterMode` "
        "counts it (matmuls, convolutions, attention where it has a formula), % of peak = "
        "that over the runner's latency over the fp32 GEMM peak; "
        + ("optimize s fresh process = `autoopt.optimize` plus its first call in a new Python "
           "process (imports not counted), twice in sequence sharing one fresh autoopt cache "
           "(`XDG_CACHE_HOME`): first = cold (every backend candidate lowered and measured), "
           "second = the first's measurements found, only the winner built (target: second ≤ "
           "¼ of first); Inductor's own on-disk caches (/tmp/torchinductor_*) are warm in both, "
           "as this row's in-process runs compiled the same graphs first; "
           if optimize_times_on else "")
        + "prepare = optimize / compile (incl. first call) / export + session time in this "
        "process; compile s = torch.compile / the other variant; held = resident memory growth "
        "from preparing (autoopt / torch.compile / the other variant; the model's own weights "
        "not counted); err = max abs difference from eager; autoopt→ORT ÷ ORT = median over "
        "rounds of autoopt's ONNX file's time over plain export's, run back to back (below 1: "
        "autoopt's export is faster under ORT); load = the 1-minute load average as the "
        "row's timed rounds ended, \"(shared)\" where it exceeds the thread count by more than "
        "half a core (other jobs held the cores: run the row again on a quiet machine).", ""]
    return "\n".join(caption + [t for table_text in tables for t in (table_text, "")]).rstrip(
        "\n") + "\n"


def call_overhead(name: str, batch: int, device: str = "cpu") -> dict[str, Any]:
    """What one call of the optimized module costs beyond running its graph: the checks of
    the module's state and the inputs, and the graph's own run, for scale.

    Cold: the graph's run replaced by a sweep over twice the last-level cache, which evicts
    what the checks read as a real run does; each call is paired with a sweep alone right
    after it, and the checks are the median over 1000 pairs of the call's time less the
    sweep's. Warm: the run replaced by a no-op, median of 21 rounds of 1000 calls."""
    model, args, kwargs = _build_model(name, batch, device)
    with torch.no_grad():
        fast = autoopt.optimize(model, args, kwargs)
        fast(*args, **kwargs)
        # White-box on purpose: the bench stubs the compiled form's run to time the checks
        # alone, which no public API offers (product code reads no module privates).
        compiled = vars(fast)["_specializations"]
        spec = compiled[0]
        run = spec.run
        alone = []
        for _ in range(15):
            start = time.perf_counter()
            run(*args, **kwargs)
            alone.append(time.perf_counter() - start)
        try:
            cold = _checks_cold(fast, spec, args, kwargs)
            spec.run = lambda *a, **k: None
            warm = []
            for _ in range(21):
                start = time.perf_counter()
                for _ in range(1000):
                    fast(*args, **kwargs)
                warm.append((time.perf_counter() - start) / 1000)
        finally:
            spec.run = run
        assert compiled == [spec], "a check dropped the graph"
    tensors = {id(t) for t in (*fast.module.parameters(), *fast.module.buffers())}
    return {"model": name, "batch": batch, "tensors": len(tensors),
            "modules": len(list(fast.module.modules())), "backend": spec.backend or "aten",
            "checks_s": cold, "checks_warm_s": statistics.median(warm),
            "run_s": statistics.median(alone)}


def _checks_cold(fast: Any, spec: Any, args: tuple, kwargs: dict, pairs: int = 1000) -> float:
    """Median over pairs of (a call whose run is a cache sweep) less (the sweep alone)."""
    memory = torch.ones(2 * _last_level_cache_bytes() // 8, dtype=torch.int64)
    spec.run = lambda *a, **k: memory.sum()
    differences = []
    for _ in range(pairs):
        start = time.perf_counter()
        fast(*args, **kwargs)
        middle = time.perf_counter()
        memory.sum()
        differences.append(2 * middle - start - time.perf_counter())
    return statistics.median(differences)


def _last_level_cache_bytes() -> int:
    """The largest CPU cache, as Linux reports it (32 MiB where it does not)."""
    sizes = []
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        text = (index / "size").read_text().strip() if (index / "size").exists() else ""
        if text[:-1].isdigit():
            sizes.append(int(text[:-1]) << {"K": 10, "M": 20, "G": 30}.get(text[-1], 0))
    return max(sizes, default=32 << 20)


def overhead_table(rows: list[dict[str, Any]]) -> str:
    lines = ["| model | batch | tensors / modules watched | per-call checks µs, caches cold "
             "(warm) | graph's run ms (backend) | checks ÷ run |", "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['batch']} | {r['tensors']} / {r['modules']} | "
                     f"{r['checks_s'] * 1e6:.0f} ({r['checks_warm_s'] * 1e6:.0f}) | "
                     f"{r['run_s'] * 1e3:.2f} ({r['backend']}) | "
                     f"{r['checks_s'] / r['run_s']:.1%} |")
    return "\n".join(lines) + "\n"


def _child_main(args: argparse.Namespace) -> int:
    torch.set_num_threads(int(args.threads))
    result = optimize_once(args.child_optimize, int(args.batches), args.device)
    child_process.report(result)
    return 0


def main() -> int:
    if "--static-int8" in sys.argv[1:]:  # its own table: bench/static_int8.py
        import static_int8

        return static_int8.main([a for a in sys.argv[1:] if a != "--static-int8"])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", default="1",
                        help="thread counts, comma-separated: one table each (e.g. 1,2)")
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    parser.add_argument("--skip", default="",
                        help="runners to leave out, comma-separated (e.g. 'compile max-autotune"
                             ",autoopt→onnxruntime'); eager and autoopt always run")
    parser.add_argument("--optimize-times", action=argparse.BooleanOptionalAction,
                        default=None, help="time autoopt.optimize in fresh processes, cold "
                        "and with its cache warm (default: on with --write)")
    parser.add_argument("--write", action="store_true", help="update docs/benchmarks.md")
    parser.add_argument("--out", type=Path, help="also write the table to this file")
    parser.add_argument("--call-overhead", action="store_true",
                        help="instead of the table: what each call of the optimized module "
                             "spends on its checks, per model and batch, with the caches cold "
                             "as after a real run (the graph's run replaced by a sweep over "
                             "twice the last-level cache, the sweep's time subtracted) and warm "
                             "(the run a no-op: several times too cheap for a large model)")
    parser.add_argument("--child-optimize", metavar="MODEL", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child_optimize:
        return _child_main(args)
    skip = frozenset(s.strip() for s in args.skip.split(",") if s.strip())
    with_times = args.write if args.optimize_times is None else args.optimize_times
    # autoopt's cost cache for this run only: its backend choices are measured in this run,
    # not read from an earlier one, and the user's cache is left alone.
    cache = tempfile.TemporaryDirectory(prefix="autoopt-bench-")
    os.environ["XDG_CACHE_HOME"] = cache.name
    if args.call_overhead:
        torch.set_num_threads(int(args.threads.split(",")[0]))
        print(overhead_table([call_overhead(name, int(batch), args.device)
                              for name in args.models.split(",")
                              for batch in args.batches.split(",")]))
        cache.cleanup()
        return 0
    thread_counts = [int(t) for t in args.threads.split(",")]
    if torch.device(args.device).type == "cuda":
        thread_counts = thread_counts[:1]
    tables = []
    for threads in thread_counts:
        torch.set_num_threads(threads)
        _warm_up(args.device)
        peak = gemm_peak(args.device)
        rows = []
        for name in args.models.split(","):
            for batch in (int(b) for b in args.batches.split(",")):
                row = bench_one(name, batch, args.rounds, args.device, skip)
                if with_times:
                    row["optimize_times"] = optimize_times(name, batch, threads, args.device)
                rows.append(row)
                print(f"{threads} thread(s) {name} b{batch}: " + ", ".join(
                    f"{k} {v * 1e3:.1f} ms" for k, v in row["median"].items()), flush=True)
        tables.append(table(rows, threads, args.device, peak, with_times))
    command = "python bench/inference.py " + " ".join(
        f"'{a}'" if " " in a else a for a in sys.argv[1:])
    publish(section(tables, command.strip(), args.device, with_times), write=args.write,
            out=args.out)
    cache.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
