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
import platform
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

from autoopt.capture import export_graph
from autoopt.cost_model import CostCache, CostModel
from autoopt.cost_model.stages import balanced_cut, split_stages

ROOT = Path(__file__).resolve().parent.parent
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


def stage_errors(cm: CostModel, gm: torch.fx.GraphModule, profile: Any, inputs: list[Any],
                 k: int) -> list[tuple[float, float]]:
    order = [n for n in gm.graph.nodes if n.op in ("call_function", "call_method", "call_module")
             and n.target != "_guards_fn"]
    groups = balanced_cut(order, profile, k)
    split = split_stages(gm, groups)
    # Run the split module once, recording each stage's inputs, then time each stage alone.
    stage_inputs: dict[str, tuple] = {}
    hooks = [getattr(split, name).register_forward_pre_hook(
        lambda mod, args, name=name: stage_inputs.__setitem__(name, args))
        for name, _ in split.named_children() if name.startswith("submod_")]
    with torch.no_grad():
        split(*inputs)
    for h in hooks:
        h.remove()
    results = []
    for i, group in enumerate(groups):
        name = f"submod_{i}"
        predicted = sum(profile.by_node[n.name].latency_s for n in group if n.name in
                        profile.by_node)
        measured = cm.measure(getattr(split, name), stage_inputs[name], repeats=15)
        results.append((predicted, measured))
    return results


def run(names: list[str], threads: int) -> list[dict[str, Any]]:
    torch.set_num_threads(threads)
    rows = []
    for name in names:
        torch.manual_seed(0)
        model, args, kwargs = MODELS[name]()
        gm = export_graph(model, args, kwargs)
        gm.graph.eliminate_dead_code()
        gm.recompile()
        inputs = [*args, *kwargs.values()]
        with tempfile.TemporaryDirectory() as tmp:
            cm = CostModel("cpu", cache=CostCache(Path(tmp) / "costs.json"))
            _ = cm.info  # ceilings are measured once per device, not part of profiling
            start = time.perf_counter()
            profile = cm.profile(gm, inputs)
            first_s = time.perf_counter() - start
            start = time.perf_counter()
            cm.profile(gm, inputs)
            cached_s = time.perf_counter() - start
            measured = cm.measure(gm, inputs)
            stages = {k: stage_errors(cm, gm, profile, inputs, k) for k in (2, 4)}
        row = {"model": name, "nodes": len(profile.nodes), "predicted_ms": profile.latency_s * 1e3,
               "measured_ms": measured * 1e3,
               "error": (profile.latency_s - measured) / measured,
               "profile_s": first_s, "cached_s": cached_s,
               "stage_error_2": max(abs(p - m) / m for p, m in stages[2]),
               "stage_error_4": max(abs(p - m) / m for p, m in stages[4])}
        rows.append(row)
        print(f"{name:<20} predicted {row['predicted_ms']:8.2f} ms  measured "
              f"{row['measured_ms']:8.2f} ms  error {row['error']:+6.1%}  stages(2) "
              f"{row['stage_error_2']:5.1%}  stages(4) {row['stage_error_4']:5.1%}  profile "
              f"{first_s:5.1f} s, cached {cached_s:4.2f} s", flush=True)
    return rows


def table(rows: list[dict[str, Any]], threads: int, command: str) -> str:
    cpu = CostModel("cpu", cache=CostCache.in_memory()).info.name
    lines = [
        "## Cost model accuracy (CPU)", "",
        f"Command: `{command}`  ",
        f"Machine: {cpu}, {threads} thread(s), torch {torch.__version__}, "
        f"Python {platform.python_version()}. Batch 1; images 224×224, text 128 tokens; "
        "random weights.", "",
        "Predicted = sum of per-node costs, each node timed alone on its real inputs (median, "
        "inputs rotated); measured = median of whole-model runs. Stage error = the worst "
        "|predicted − measured| / measured over the stages of a cut into K contiguous stages "
        "of equal predicted time, each stage run alone. Profile = first profiling with an "
        "empty cache; cached = the same with the cache filled.", "",
        "| model | nodes | predicted ms | measured ms | error | worst stage error, K=2 | "
        "worst stage error, K=4 | profile s | cached s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(f"| {r['model']} | {r['nodes']} | {r['predicted_ms']:.2f} | "
                     f"{r['measured_ms']:.2f} | {r['error']:+.1%} | {r['stage_error_2']:.1%} | "
                     f"{r['stage_error_4']:.1%} | {r['profile_s']:.1f} | {r['cached_s']:.2f} |")
    return "\n".join(lines) + "\n"


def write_section(path: Path, section: str) -> None:
    """Replace this benchmark's section of docs/benchmarks.md, keeping the others."""
    title = section.splitlines()[0]
    text = path.read_text() if path.exists() else "# Benchmarks\n\n"
    if title in text:
        before, rest = text.split(title, 1)
        after = rest.split("\n## ", 1)
        text = before + section + ("\n## " + after[1] if len(after) > 1 else "")
    else:
        text = text.rstrip("\n") + "\n\n" + section
    path.write_text(text)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--write", action="store_true", help="update docs/benchmarks.md")
    args = parser.parse_args()
    rows = run(args.models.split(","), args.threads)
    command = "python bench/cost_model_accuracy.py " + " ".join(sys.argv[1:])
    section = table(rows, args.threads, command.strip())
    print(section)
    if args.write:
        write_section(ROOT / "docs" / "benchmarks.md", section)
    return 0


if __name__ == "__main__":
    sys.exit(main())
