"""Optimize at scale: memory and time of ``autoopt.optimize`` on Llama-style decoders, by size.

    python bench/scale.py [--sizes 50M,100M,200M,500M] [--threads 2] [--all-backends]
                          [--compile] [--onnx] [--peer-sizes 50M,100M] [--stages 200M]
                          [--optimize-memory 1GiB] [--note TEXT] [--write] [--out table.md]

Models: ``transformers`` ``LlamaForCausalLM`` from a config (random weights, fp32,
``use_cache=False``, vocabulary 32000, head size 64, untied embeddings), batch 1 × 128 tokens.
Sizes (``--sizes``, any of): 50M, 100M, 200M, 500M, 1B; ``NAME@LAYERS`` (``100M@4,100M@16``)
takes that size's width with another number of layers, so optimize time against depth is seen
at one width (each added layer repeats the same shapes). Each size and each runner runs in a
fresh Python process, so one's peak cannot hide in another's: the model is built, called once
eagerly (no_grad), freed heap is handed back to the system (``malloc_trim``) and the resident
memory read (``/proc/self/statm``); the process's peak resident memory is then reset
(``/proc/self/clear_refs``) and the runner prepared:

* autoopt: ``autoopt.optimize(model, (ids,))`` with ``AUTOOPT_BACKENDS=aten`` unless
  ``--all-backends`` (then aten, Inductor and ONNX Runtime are built, verified and measured);
  the optimized module's first call is checked against eager.
* torch.compile (``--compile``): ``torch.compile(model)`` and its first call.
* ONNX Runtime (``--onnx``): ``torch.onnx.export(..., dynamo=True)``, an ``InferenceSession``
  (CPU, all graph optimizations) and its first run.

``--peer-sizes`` limits the torch.compile and ONNX Runtime rows to some sizes (they take
minutes each at the larger ones).

Reported per size: parameters, layers, weights' bytes, resident memory after the eager call,
the peak growth while preparing (peak resident minus the resident memory before), the memory
held afterwards (resident after ``gc`` and ``malloc_trim`` minus before: what the optimized
module keeps beyond the user's model), optimize time and time per layer. ``--stages SIZE`` adds
``autoopt.observe.memory_profile``'s table (each stage's resident memory before, after and at its
peak) for that size. All processes of one run share one fresh autoopt cache
(``XDG_CACHE_HOME``), whose device ceilings are measured before the first row: each model's
kernel choices are measured in its own row, and a decoder's repeated layers share them.
``--optimize-memory`` passes ``optimize_memory=`` to ``optimize``; what it left out is listed
under the table. ``--write`` updates docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

# (hidden size, layers, MLP width): Llama proportions, parameters about the name.
SIZES = {
    "50M": (512, 8, 1408),
    "100M": (768, 8, 2048),
    "200M": (1024, 10, 2816),
    "500M": (1536, 14, 4096),
    "1B": (2048, 18, 5632),
}
RUNNERS = ("autoopt", "torch.compile", "onnxruntime")
CHILD_MARK = "SCALE_CHILD_RESULT "
_GIB = 2**30


# --- one measurement, in a child process ---------------------------------------------------


def _rss() -> int:
    """Resident bytes now, after handing freed heap back to the system."""
    gc.collect()
    if sys.platform.startswith("linux"):
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak() -> int:
    with open("/proc/self/status") as status:
        match = re.search(r"VmHWM:\s+(\d+) kB", status.read())
    assert match, "no VmHWM in /proc/self/status"
    return int(match.group(1)) * 1024


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _shape(size: str) -> tuple[int, int, int]:
    """(hidden size, layers, MLP width) of ``NAME`` or ``NAME@LAYERS``."""
    name, _, depth = size.partition("@")
    hidden, layers, mlp = SIZES[name]
    return hidden, int(depth) if depth else layers, mlp


def _known(size: str) -> bool:
    name, _, depth = size.partition("@")
    return name in SIZES and (not depth or (depth.isdigit() and int(depth) > 0))


def _model(size: str) -> tuple[Any, Any, int]:
    import torch
    import transformers

    transformers.logging.set_verbosity_error()
    hidden, layers, mlp = _shape(size)
    config = transformers.LlamaConfig(
        vocab_size=32000, hidden_size=hidden, intermediate_size=mlp, num_hidden_layers=layers,
        num_attention_heads=hidden // 64, num_key_value_heads=hidden // 64,
        max_position_embeddings=256, use_cache=False)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    ids = torch.randint(0, config.vocab_size, (1, 128))
    return model, ids, layers


def _logits(out: Any) -> Any:
    return out.logits if hasattr(out, "logits") else out[0]


def child(size: str, runner: str, threads: int, stages: bool,
          optimize_memory: str | None = None) -> dict[str, Any]:
    """Prepare ``runner`` on the ``size`` model in this process and measure it."""
    import torch

    torch.set_num_threads(threads)
    import autoopt
    from autoopt.observe import memory_profile

    model, ids, layers = _model(size)
    with torch.no_grad():
        expected = _logits(model(ids))
    weights = sum(t.numel() * t.element_size() for t in model.parameters())
    result: dict[str, Any] = {
        "size": size, "runner": runner, "layers": layers, "weights": weights,
        "params": sum(t.numel() for t in model.parameters())}
    before = _rss()
    result["eager_rss"] = before
    _reset_peak()
    start = time.perf_counter()
    profile: list[Any] = []
    if runner == "autoopt":
        with memory_profile.recording() as profile, memory_profile.stage("optimize"):
            prepared = autoopt.optimize(model, (ids,), optimize_memory=optimize_memory)
        seconds = time.perf_counter() - start
        peak = profile[0].peak if profile[0].peak is not None else _peak()
        run = prepared
        result["backends"] = sorted({c.chosen for c in prepared.report.backends}) or ["eager"]
        result["rolled_back"] = prepared.report.rolled_back
        result["left_out"] = [note for c in prepared.report.captures for note in c.memory] + [
            f"the {name} backend: {why}" for choice in prepared.report.backends
            for name, why in choice.skipped.items() if "for memory" in why]
    elif runner == "torch.compile":
        compiled = torch.compile(model)
        with torch.no_grad():
            compiled(ids)
        seconds, peak, run = time.perf_counter() - start, _peak(), compiled
    else:
        run = _onnx_runner(model, ids, threads)
        seconds, peak = time.perf_counter() - start, _peak()
    with torch.no_grad():
        actual = _logits(run(ids))
    result["err"] = float((actual - expected).abs().max())
    del actual, expected
    result.update(seconds=seconds, peak_growth=peak - before, held=_rss() - before)
    if stages and profile:
        result["stages"] = memory_profile.describe(profile)
    return result


def _onnx_runner(model: Any, ids: Any, threads: int) -> Any:
    import onnxruntime as ort
    import torch

    path = Path(tempfile.mkdtemp()) / "model.onnx"
    torch.onnx.export(model, (ids,), str(path), dynamo=True, external_data=True)
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    name = session.get_inputs()[0].name
    session.run(None, {name: ids.numpy()})
    return lambda x: torch.from_numpy(session.run(None, {name: x.numpy()})[0])


# --- the table -------------------------------------------------------------------------------


def _run_child(size: str, runner: str, args: argparse.Namespace, env: dict[str, str],
               ) -> dict[str, Any]:
    command = [sys.executable, __file__, "--child", size, "--runner", runner,
               "--threads", str(args.threads)] + (["--stages", size] if size in args.stages
                                                  and runner == "autoopt" else []) \
        + (["--optimize-memory", args.optimize_memory] if args.optimize_memory else [])
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    for line in done.stdout.splitlines():
        if line.startswith(CHILD_MARK):
            return json.loads(line[len(CHILD_MARK):])
    tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
    return {"size": size, "runner": runner, "failed": tail[:200]}


def _gib(n: float) -> str:
    return f"{n / _GIB:.2f}"


def _times(n: float, weights: float) -> str:
    return f"{n / _GIB:+.2f} GiB ({n / weights:.2f}×)"


def table(rows: list[dict[str, Any]], args: argparse.Namespace, command: str,
          machine: str) -> str:
    backends = ("aten, Inductor and ONNX Runtime (`--all-backends`)" if args.all_backends
                else "`AUTOOPT_BACKENDS=aten` (the other backends' lowering and measuring "
                     "left out; `--all-backends` adds them)")
    lines = [
        "## Optimize at scale: memory and time by model size (CPU)",
        "",
        f"Command: `{command}`  ",
        f"Machine: {machine}, {args.threads} thread(s), torch {_version('torch')}, "
        f"transformers {_version('transformers')}. Llama-style decoders "
        f"(`LlamaForCausalLM`, random fp32 weights, `use_cache=False`, batch 1 × 128 tokens), "
        f"each size and runner in a fresh process. autoopt: {backends}. weights = the "
        f"parameters' bytes; eager RSS = resident memory after one eager call; peak = the "
        f"process's peak resident memory while preparing, minus the resident memory before "
        f"(× the weights; target ≤ 1.5×); held = resident memory after preparing (gc, "
        f"`malloc_trim`) minus before: what the optimized module keeps beyond your model "
        f"(target ≤ 1.0×); s/layer = optimize seconds over decoder layers (target: flat "
        f"within ±30%); err = max abs difference of the logits from eager. One shared fresh "
        f"autoopt cache per run (device ceilings measured before the first row). "
        + (args.note + " " if args.note else ""),
        "",
    ]
    header = ["model", "params", "layers", "weights GiB", "eager RSS GiB",
              "autoopt peak", "autoopt held", "optimize s", "s/layer", "autoopt err",
              "backend"]
    extra = [r for r in RUNNERS[1:] if any(row["runner"] == r for row in rows)]
    for name in extra:
        header += [f"{name} peak", f"{name} held", f"{name} s"]
    lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for size in dict.fromkeys(r["size"] for r in rows):
        by = {r["runner"]: r for r in rows if r["size"] == size}
        base = next((r for r in by.values() if "failed" not in r), None)
        if base is None:
            lines.append(f"| {size} | failed: {next(iter(by.values()))['failed']} |")
            continue
        w = base["weights"]
        cells = [size, f"{base['params'] / 1e6:.0f} M", str(base["layers"]), _gib(w),
                 _gib(base["eager_rss"])]
        a = by.get("autoopt", {})
        if "failed" in a or not a:
            cells += [f"failed: {a.get('failed', 'not run')}"] + [""] * 5
        else:
            cells += [_times(a["peak_growth"], w), _times(a["held"], w), f"{a['seconds']:.1f}",
                      f"{a['seconds'] / a['layers']:.2f}", f"{a['err']:.1e}",
                      ", ".join(a["backends"])]
        for name in extra:
            r = by.get(name, {})
            if not r:
                cells += ["not run"] * 3
            elif "failed" in r:
                cells += [f"failed: {r['failed']}", "", ""]
            else:
                cells += [_times(r["peak_growth"], w), _times(r["held"], w),
                          f"{r['seconds']:.1f}"]
        lines.append("| " + " | ".join(cells) + " |")
    per_layer = [r["seconds"] / r["layers"] for r in rows
                 if r["runner"] == "autoopt" and "failed" not in r]
    if len(per_layer) > 1:
        lines += ["", f"Optimize seconds per layer: {min(per_layer):.2f} to "
                      f"{max(per_layer):.2f} (largest over smallest "
                      f"{max(per_layer) / min(per_layer):.2f}×)."]
    lines += _depth_lines(rows)
    for r in rows:
        for note in r.get("left_out", []):
            lines += ["", f"{r['size']}: left out for memory: {note}"]
    for r in rows:
        if r.get("stages"):
            lines += ["", f"Memory by stage of `autoopt.optimize`, {r['size']} model "
                          f"(`autoopt.observe.memory_profile`; resident GiB; growth = the stage's "
                          f"peak over its start):", "", "```", r["stages"], "```"]
    return "\n".join(lines) + "\n"


def _depth_lines(rows: list[dict[str, Any]]) -> list[str]:
    """For each width run at three or more depths: the seconds each added layer cost (the
    slope between consecutive depths). The width's first row measures the kernels of its
    distinct shapes into the shared cache and the rows after it find them, so slopes are
    taken from the second row on; what the first row spent beyond the line is said apart."""
    by_width: dict[int, list[tuple[int, float]]] = {}
    for r in rows:
        if r["runner"] == "autoopt" and "failed" not in r:
            by_width.setdefault(_shape(r["size"])[0], []).append((r["layers"], r["seconds"]))
    lines = []
    for width, runs in by_width.items():
        first, later = runs[0], sorted(dict(runs[1:]).items())
        pairs = list(zip(later, later[1:], strict=False))
        if not pairs or any(b[0] <= a[0] for a, b in pairs):
            continue
        slopes = [(b[1] - a[1]) / (b[0] - a[0]) for a, b in pairs]
        fixed = later[0][1] - slopes[0] * later[0][0]
        measured = first[1] - (fixed + slopes[0] * first[0])
        steps = ", ".join(f"{a[0]}→{b[0]} layers: {slope:.2f}"
                          for (a, b), slope in zip(pairs, slopes, strict=True))
        spread = (f"largest over smallest {max(slopes) / min(slopes):.2f}×"
                  if min(slopes) > 0 else "not all positive")
        lines += ["", f"Width {width}, optimize seconds per added layer, its shapes' kernels "
                      f"already measured ({steps}): {spread}; fixed part about {fixed:.1f} s; "
                      f"the first row ({first[0]} layers) spent {measured:.1f} s more, "
                      f"measuring the kernels of the width's distinct shapes once."]
    return lines


def _version(name: str) -> str:
    try:
        return __import__(name).__version__
    except ImportError:
        return "absent"


def _machine() -> str:
    try:
        from autoopt.cost_model import device_info

        name = device_info("cpu", measure=False).name
    except Exception:  # noqa: BLE001 - the name is a label only
        name = platform.processor() or platform.machine()
    return f"{name} ({os.cpu_count()} logical CPUs)"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="50M,100M,200M,500M",
                        help=f"comma-separated, of {','.join(SIZES)}")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--all-backends", action="store_true",
                        help="autoopt measures aten, Inductor and ONNX Runtime (default: aten)")
    parser.add_argument("--compile", action="store_true", help="add torch.compile's rows")
    parser.add_argument("--onnx", action="store_true", help="add export + ONNX Runtime's rows")
    parser.add_argument("--peer-sizes", default="",
                        help="sizes to run torch.compile/ONNX Runtime on (default: all)")
    parser.add_argument("--stages", default="",
                        help="sizes whose per-stage memory profile is printed, e.g. 200M")
    parser.add_argument("--optimize-memory", default=None,
                        help="optimize_memory= for autoopt, e.g. 1GiB (default: what is free)")
    parser.add_argument("--note", default="", help="a sentence for the table's notes")
    parser.add_argument("--write", action="store_true", help="update docs/benchmarks.md")
    parser.add_argument("--out", type=Path, help="also write the table to this file")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--runner", default="autoopt", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.stages = [s for s in args.stages.split(",") if s]
    if args.child:
        result = child(args.child, args.runner, args.threads, args.child in args.stages,
                       args.optimize_memory)
        print(CHILD_MARK + json.dumps(result), flush=True)
        return 0
    sizes = [s for s in args.sizes.split(",") if s]
    unknown = [s for s in sizes if not _known(s)]
    if unknown:
        parser.error(f"unknown size(s) {unknown}; known: {list(SIZES)}, each optionally "
                     f"@LAYERS (100M@16)")
    runners = ["autoopt"] + (["torch.compile"] if args.compile else []) \
        + (["onnxruntime"] if args.onnx else [])
    cache = tempfile.mkdtemp(prefix="autoopt-scale-cache-")
    env = {**os.environ, "XDG_CACHE_HOME": cache, "OMP_NUM_THREADS": str(args.threads)}
    if not args.all_backends:
        env["AUTOOPT_BACKENDS"] = "aten"
    # Device ceilings into the shared cache first, so the first row does not pay for them.
    subprocess.run([sys.executable, "-c", "from autoopt.cost_model import CostModel; "
                    "CostModel('cpu').info"], env=env, check=True)
    rows = []
    peer_sizes = [s for s in args.peer_sizes.split(",") if s] or sizes
    for size in sizes:
        for runner in runners:
            if runner != "autoopt" and size not in peer_sizes:
                continue
            print(f"[scale] {size}: {runner} ...", flush=True)
            row = _run_child(size, runner, args, env)
            rows.append(row)
            if "failed" in row:
                print(f"[scale] {size}: {runner} failed: {row['failed']}", flush=True)
            else:
                print(f"[scale] {size}: {runner} {row['seconds']:.1f} s, peak "
                      f"{_times(row['peak_growth'], row['weights'])}, held "
                      f"{_times(row['held'], row['weights'])}", flush=True)
    from cost_model_accuracy import publish

    command = "python bench/scale.py " + " ".join(sys.argv[1:])
    publish(table(rows, args, command.strip(), _machine()), write=args.write, out=args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
