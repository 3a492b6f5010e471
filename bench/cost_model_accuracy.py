"""How close the cost model's predictions come to measured time, per model and per stage.

    python bench/cost_model_accuracy.py [--threads 1] [--models resnet50,bert] [--write]

For each model (random weights, full size): capture with torch.export, profile every node on
this device (timed, first with an empty cache, then again from the cache), predict the whole
model's latency as the sum of node costs, and measure it (median of repeats). Then cut the
graph into 2 and 4 contiguous stages of equal predicted time, run each stage alone and compare.
``--write`` puts the table into docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import os
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

from autoopt.capture.graph import export_graph, flat_example_inputs
from autoopt.cost_model import CostCache, CostModel
from autoopt.cost_model.device import device_info
from autoopt.cost_model.stages import balanced_cut, split_stages

ROOT = Path(__file__).resolve().parent.parent
ROUNDS = 5
CPU = torch.device("cpu")
transformers.logging.set_verbosity_error()


def _text(config: Any, model_cls: type, seq: int = 128) -> tuple[nn.Module, tuple, dict]:
    ids = torch.randint(0, 1000, (1, seq))
    return model_cls(config).eval(), (ids,), {}


MODELS: dict[str, Callable[[], tuple[nn.Module, tuple, dict]]] = {
    "resnet50": lambda: (torchvision.models.resnet50().eval(), (torch.randn(1, 3, 224, 224),), {}),
    "mobilenet_v3_large": lambda: (torchvision.models.mobilenet_v3_large().eval(),
                                   (torch.randn(1, 3, 224, 224),), {}),
    "vit_b_16": lambda: (torchvision.models.vit_b_16().eval(), (torch.randn(1, 3, 224, 224),), {}),
    "bert-base": lambda: _text(transformers.BertConfig(), transformers.BertModel),
    "gpt2": lambda: (*_text(transformers.GPT2Config(use_cache=False), transformers.GPT2Model)[:2],
                     {"use_cache": False}),
}


def _stage_runner(gm: torch.fx.GraphModule, groups: list[list[Any]], inputs: list[Any]
                  ) -> tuple[torch.fx.GraphModule, dict[str, tuple]]:
    """The graph split into the groups' stages, and each stage's recorded inputs."""
    split = split_stages(gm, groups)
    stage_inputs: dict[str, tuple] = {}
    hooks = [getattr(split, name).register_forward_pre_hook(
        lambda mod, args, name=name: stage_inputs.__setitem__(name, args))
        for name, _ in split.named_children() if name.startswith("submod_")]
    with torch.no_grad():
        split(*inputs)
    for h in hooks:
        h.remove()
    return split, stage_inputs


def _clock(device: torch.device) -> float:
    """Now, after the device's queued work (CUDA calls return before it is done)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def _stage_times_in_situ(split: torch.fx.GraphModule, inputs: list[Any], k: int,
                         repeats: int = 11, device: torch.device = CPU) -> list[float]:
    """Median time of each stage as it runs inside whole-model runs of the split module
    (timed between hooks at its boundaries), so a stage sees the caches a model run leaves,
    not those of the same stage looping alone."""
    samples: list[list[float]] = [[] for _ in range(k)]
    starts: dict[int, float] = {}
    hooks = []
    for i in range(k):
        stage = getattr(split, f"submod_{i}")
        hooks.append(stage.register_forward_pre_hook(
            lambda mod, args, i=i: starts.__setitem__(i, _clock(device))))
        hooks.append(stage.register_forward_hook(
            lambda mod, args, out, i=i: samples[i].append(_clock(device) - starts[i])))
    with torch.no_grad():
        for _ in range(3):
            split(*inputs)
        for s in samples:
            s.clear()
        for _ in range(repeats):
            split(*inputs)
    for h in hooks:
        h.remove()
    return [statistics.median(s) for s in samples]


def run(names: list[str], threads: int, rounds: int, device: str = "cpu",
        ) -> list[dict[str, Any]]:
    """Per model: ``rounds`` interleaved rounds of (profile from scratch, measure the model,
    measure each stage); errors are medians over rounds, so drift of this shared machine
    between rounds does not decide the figure."""
    torch.set_num_threads(threads)
    rows = []
    for name in names:
        torch.manual_seed(0)
        model, args, kwargs = MODELS[name]()
        target = torch.device(device)
        model = model.to(target)
        args = tuple(a.to(target) if isinstance(a, torch.Tensor) else a for a in args)
        gm = export_graph(model, args, kwargs)
        gm.graph.eliminate_dead_code()
        gm.recompile()
        inputs = list(flat_example_inputs(gm, args, kwargs))
        with tempfile.TemporaryDirectory() as tmp:
            cm = CostModel(target, cache=CostCache(Path(tmp) / "costs.json"))
            _ = cm.info  # ceilings are measured once per device, not part of profiling
            start = time.perf_counter()
            first = cm.profile(gm, inputs)
            first_s = time.perf_counter() - start
            start = time.perf_counter()
            cm.profile(gm, inputs)
            cached_s = time.perf_counter() - start
        order = [n for n in gm.graph.nodes if n.op == "call_function"]
        cuts = {k: balanced_cut(order, first, k) for k in (2, 4)}
        runners = {k: _stage_runner(gm, cuts[k], inputs) for k in cuts}
        errors: list[float] = []
        stage_errors: dict[int, list[float]] = {2: [], 4: []}
        predicted_ms, measured_ms = [], []
        for _ in range(rounds):
            cm = CostModel(target, cache=CostCache.in_memory())
            profile = cm.profile(gm, inputs, in_model=True)
            measured = cm.measure(gm, args, kwargs, repeats=11)
            predicted_ms.append(profile.latency_s * 1e3)
            measured_ms.append(measured * 1e3)
            errors.append((profile.latency_s - measured) / measured)
            for k, (split, _) in runners.items():
                actual = _stage_times_in_situ(split, inputs, len(cuts[k]), device=target)
                worst = 0.0
                for i, group in enumerate(cuts[k]):
                    predicted = sum(profile.by_node[n.name].stage_s for n in group
                                    if n.name in profile.by_node)
                    worst = max(worst, abs(predicted - actual[i]) / actual[i])
                stage_errors[k].append(worst)
        row = {"model": name, "nodes": len(order),
               "predicted_ms": statistics.median(predicted_ms),
               "measured_ms": statistics.median(measured_ms),
               "error": statistics.median(errors), "error_range": (min(errors), max(errors)),
               "profile_s": first_s, "cached_s": cached_s,
               "stage_error_2": statistics.median(stage_errors[2]),
               "stage_error_4": statistics.median(stage_errors[4])}
        rows.append(row)
        print(f"{name:<20} predicted {row['predicted_ms']:8.2f} ms  measured "
              f"{row['measured_ms']:8.2f} ms  error {row['error']:+6.1%} "
              f"[{min(errors):+.0%}, {max(errors):+.0%}]  stages(2) {row['stage_error_2']:5.1%}"
              f"  stages(4) {row['stage_error_4']:5.1%}  profile {first_s:5.1f} s, cached "
              f"{cached_s:4.2f} s", flush=True)
    return rows


def table(rows: list[dict[str, Any]], threads: int, command: str, device: str = "cpu") -> str:
    target = torch.device(device)
    name = CostModel(target, cache=CostCache.in_memory()).info.name
    kind = "CUDA" if target.type == "cuda" else "CPU"
    threads_text = f", {threads} thread(s)" if target.type == "cpu" else ""
    lines = [
        f"## Cost model accuracy ({kind})", "",
        f"Command: `{command}`  ",
        f"Machine: {name}{threads_text}, torch {torch.__version__}, "
        f"Python {platform.python_version()}. Batch 1; images 224×224, text 128 tokens; "
        "random weights.", "",
        "Predicted = sum of per-node costs, each node timed alone on its real inputs (median of "
        "repeats, L2 evicted before each); measured = median of whole-model runs. Stage error "
        "= the worst |predicted − measured| / measured over the stages of a cut into K "
        "contiguous stages of equal predicted time, where a stage's prediction adds up its "
        "nodes' in-model times (`profile(in_model=True)`: each node timed where it stands in "
        "5 separate whole-graph runs, median) and its measurement times the stage inside other "
        "whole-model runs (hooks at its boundaries). Each figure is the "
        f"median over {ROUNDS} interleaved rounds (profile, model, stages), with the range of "
        "the whole-model error. Profile = first profiling with an empty cache; cached = the "
        "same with the cache filled.", "",
        "| model | compute nodes | predicted ms | measured ms | error (range) | worst stage "
        "error, K=2 | worst stage error, K=4 | profile s | cached s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        low, high = r["error_range"]
        lines.append(f"| {r['model']} | {r['nodes']} | {r['predicted_ms']:.2f} | "
                     f"{r['measured_ms']:.2f} | {r['error']:+.1%} ({low:+.0%} to {high:+.0%}) | "
                     f"{r['stage_error_2']:.1%} | "
                     f"{r['stage_error_4']:.1%} | {r['profile_s']:.1f} | {r['cached_s']:.2f} |")
    return "\n".join(lines) + "\n"


def write_section(path: Path, section: str) -> None:
    """Replace this benchmark's section of docs/benchmarks.md, keeping the others, and the
    section's ``###`` subsections the new text does not have (a run at one thread count
    keeps the other's table and the notes written under their own headings)."""
    title = section.splitlines()[0]
    text = path.read_text() if path.exists() else "# Benchmarks\n\n"
    if title in text:
        before, rest = text.split(title, 1)
        after = rest.split("\n## ", 1)
        kept = [part for part in after[0].split("\n### ")[1:]
                if f"\n### {part.splitlines()[0]}\n" not in f"\n{section}\n"]
        if kept:
            section = section.rstrip("\n") + "\n\n" + "".join(
                "### " + part.rstrip("\n") + "\n\n" for part in kept)
        text = before + section + ("\n## " + after[1] if len(after) > 1 else "")
    else:
        text = text.rstrip("\n") + "\n\n" + section
    path.write_text(text)


def first_tensor(out: Any) -> torch.Tensor:
    """A model's main output tensor, to compare runners by: the output itself, a transformers
    output's ``last_hidden_state``, else its first element (a tuple, a list, a ModelOutput)."""
    if isinstance(out, torch.Tensor):
        return out
    if hasattr(out, "last_hidden_state"):
        return out.last_hidden_state
    return first_tensor(out[0])


def heading(name: str, device: torch.device) -> tuple[str, str]:
    """A benchmark section's title (``## name (CPU)`` or ``(CUDA)``) and the machine it ran
    on, for its first line."""
    if device.type == "cuda":
        return f"## {name} (CUDA)", torch.cuda.get_device_name(device)
    return (f"## {name} (CPU)",
            f"{device_info('cpu', measure=False).name} ({os.cpu_count()} logical CPUs)")


def publish(section: str, *, write: bool, out: Path | None = None) -> None:
    """Print a benchmark's table; also into ``out`` and, with ``write``, into its section of
    docs/benchmarks.md."""
    print(section)
    if out is not None:
        out.write_text(section)
    if write:
        write_section(ROOT / "docs" / "benchmarks.md", section)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    parser.add_argument("--write", action="store_true", help="update docs/benchmarks.md")
    parser.add_argument("--out", type=Path, help="also write the table to this file")
    args = parser.parse_args()
    global ROUNDS
    ROUNDS = args.rounds
    rows = run(args.models.split(","), args.threads, args.rounds, args.device)
    command = "python bench/cost_model_accuracy.py " + " ".join(sys.argv[1:])
    section = table(rows, args.threads, command.strip(), args.device)
    publish(section, write=args.write, out=args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
