"""Training step: eager fp32, eager + autocast bf16, torch.compile + autocast, and autoopt
(fp32, bf16, and after ``Diagnosis.apply()``), with step time, MFU and peak memory.

    python bench/training.py --write                        # CPU sizes, docs/benchmarks.md
    python bench/training.py --models resnet50 --rounds 1   # a quick look
    python bench/training.py --device cuda --out train.md   # the issue's sizes on a GPU

Models (random weights, configs built in code, nothing downloaded), at the issue's sizes:
resnet50 (batch 64, 224x224), BERT-base (``BertForMaskedLM``, batch 32, sequence 128), GPT-2
small shape (``GPT2LMHeadModel``, batch 8, sequence 1024) and a Llama-style decoder of ~300M
parameters (``LlamaForCausalLM``: 20 layers, width 1024, 16 heads over 8 KV heads, SwiGLU 2816,
vocabulary 32000; batch 8, sequence 1024). On a CPU the default sizes are far smaller (``CPU``
below: the same models, fewer images and tokens); ``--full`` takes the issue's sizes,
``--batch``/``--seq`` set them.

A step is forward, loss (cross-entropy over the logits, in fp32), backward and
``zero_grad(set_to_none=True)``, with no optimizer update (but in the ``+ AdamW`` runners):
the same step ``autoopt.diagnose`` times without ``optimizer=`` (and ``Diagnosis.apply()``
measures), and the one ``torch.utils.flop_counter`` counts (an update's FLOPs are not counted).
Runners, interleaved per round, medians over rounds, after two warm-up steps each:

- ``eager fp32``; ``eager autocast bf16`` (``torch.autocast``);
- ``compile autocast bf16``: ``torch.compile(model)`` called under autocast (compile time is
  its setup);
- ``autoopt fp32``: ``autoopt.optimize(model, ..., training=True)``;
- ``autoopt bf16``: the same with ``precision="bf16"``;
- ``autoopt apply``: ``autoopt.diagnose(model, ..., training=True)`` then ``.apply()``: the
  findings' fixes, kept only where its measured step is faster;
- ``eager fp32 + AdamW`` and ``autoopt apply + AdamW``: the step with an optimizer update
  (``torch.optim.AdamW``, PyTorch's default implementation), eager on a copy of the model, and
  after ``.apply()`` of ``autoopt.diagnose(..., optimizer=adamw)``, which also tries the
  whole-step remedies (the update fused; on CUDA TF32, cuDNN benchmark, a CUDA graph of the
  whole step) and runs the step as it kept them. Their speed-up is over ``eager fp32 + AdamW``.

Columns: step time; MFU (``autoopt.diagnose``'s figure: FLOPs of forward and backward from
``torch.utils.flop_counter`` per compute dtype, over the step time, against the cost model's
measured GEMM peak in that dtype); peak memory of a step (CUDA: ``max_memory_allocated``,
weights included; CPU: resident memory's growth during the step over before it); speed-up
over eager fp32; setup (optimize or compile, and the warm-up steps).

``--validate N`` times a training loop that validates instead (its own table): N rounds of a
training step with an SGD update, then a validation of ``--val-batches`` calls in eval mode
under ``no_grad``, eager and autoopt (``optimize(..., training=True)``). Each update makes
autoopt's inference graph stale (folded BatchNorm, packed weights): the first validation
captures it, each later one rebuilds it from its exported graph (docs/recapture.md). Columns:
the first validation, the median of the later ones, that over eager's, and the graphs built.

    python bench/training.py --validate 5 --models resnet50 --seq 64 --threads 1
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import gc
import os
import platform
import shlex
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
import transformers
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cost_model_accuracy import heading, publish  # noqa: E402

import autoopt  # noqa: E402
from autoopt.diagnose.mfu import StepFlops, held_to_peak, step_flops  # noqa: E402
from autoopt.diagnose.workload import Workload  # noqa: E402
from autoopt.observe.memory_profile import (  # noqa: E402
    peak_rss_bytes,
    release_free_memory,
    reset_peak_rss,
    rss_bytes,
)

transformers.logging.set_verbosity_error()

RUNNERS = ("eager fp32", "eager autocast bf16", "compile autocast bf16", "autoopt fp32",
           "autoopt bf16", "autoopt apply", "eager fp32 + AdamW", "autoopt apply + AdamW")
_ADAMW = " + AdamW"  # runners whose step ends with an AdamW update


@dataclass(frozen=True)
class Case:
    """A model and its inputs at the issue's sizes (``full``) and this CPU's (``cpu``)."""

    build: Callable[[], nn.Module]
    full: tuple[int, int]  # (batch, sequence length; image side for resnet50)
    cpu: tuple[int, int]
    tokens: bool = True  # inputs are token ids (else images)


def resnet50() -> nn.Module:
    import torchvision

    return torchvision.models.resnet50()


def bert_base() -> nn.Module:
    return transformers.BertForMaskedLM(transformers.BertConfig())  # BERT-base's shape


def gpt2() -> nn.Module:
    config = transformers.GPT2Config(vocab_size=50257, n_embd=768, n_layer=12, n_head=12,
                                     n_positions=1024, use_cache=False)
    return transformers.GPT2LMHeadModel(config)


def llama_300m() -> nn.Module:
    config = transformers.LlamaConfig(vocab_size=32000, hidden_size=1024,
                                      intermediate_size=2816, num_hidden_layers=20,
                                      num_attention_heads=16, num_key_value_heads=8,
                                      max_position_embeddings=1024, use_cache=False)
    return transformers.LlamaForCausalLM(config)


CASES: dict[str, Case] = {
    "resnet50": Case(resnet50, full=(64, 224), cpu=(2, 224), tokens=False),
    "bert-base": Case(bert_base, full=(32, 128), cpu=(1, 128)),
    "gpt2": Case(gpt2, full=(8, 1024), cpu=(1, 128)),
    "llama-300m": Case(llama_300m, full=(8, 1024), cpu=(1, 128)),
}


@dataclass
class Row:
    model: str
    runner: str
    step_s: float | None = None
    flops: StepFlops | None = None
    memory: int | None = None  # bytes
    setup_s: float | None = None
    speedup: float | None = None
    note: str = ""
    samples: list[float] = field(default_factory=list)


def inputs(name: str, case: Case, model: nn.Module, batch: int, seq: int,
           device: torch.device) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    if not case.tokens:
        return ((torch.randn(batch, 3, seq, seq, device=device),),
                torch.randint(0, 1000, (batch,), device=device))
    ids = torch.randint(0, model.config.vocab_size, (batch, seq), device=device)
    return (ids,), torch.randint(0, model.config.vocab_size, (batch, seq), device=device)


def loss_of(out: Any, target: torch.Tensor) -> torch.Tensor:
    """Cross-entropy over the logits in fp32 (an image model's output, or ``.logits``)."""
    logits = out if isinstance(out, torch.Tensor) else out.logits
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), target.reshape(-1))


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def autocast(device: torch.device, enabled: bool) -> contextlib.AbstractContextManager[Any]:
    return torch.autocast(device.type, torch.bfloat16, enabled=enabled)


def step_of(model: nn.Module, args: tuple[torch.Tensor, ...], target: torch.Tensor,
            device: torch.device, low: bool = False,
            optimizer: torch.optim.Optimizer | None = None) -> Callable[[], None]:
    """One training step of ``model``: forward (under autocast when ``low``), loss,
    backward, the ``optimizer``'s update if any, gradients dropped; returns once the device
    has finished."""
    def step() -> None:
        with autocast(device, low):
            out = model(*args)
        loss_of(out, target).backward()
        if optimizer is not None:
            optimizer.step()
        model.zero_grad(set_to_none=True)
        sync(device)
    return step


def adamw(model: nn.Module) -> torch.optim.Optimizer:
    """The optimizer of the ``+ AdamW`` runners: PyTorch's default implementation (foreach
    on CUDA, a loop over the parameters on a CPU)."""
    return torch.optim.AdamW(model.parameters(), lr=1e-5)


def peak_memory(step: Callable[[], None], device: torch.device) -> int | None:
    """Bytes a step holds at its peak: CUDA's ``max_memory_allocated`` (weights included);
    on a CPU the resident memory's growth over before the step (None where unmeasurable)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        step()
        return torch.cuda.max_memory_allocated(device)
    release_free_memory()
    if not reset_peak_rss():
        return None
    before = rss_bytes()
    step()
    peak = peak_rss_bytes()
    return max(0, peak - before) if peak is not None else None


def count_flops(model: nn.Module, args: tuple[torch.Tensor, ...], target: torch.Tensor,
                device: torch.device, low: bool = False) -> StepFlops | None:
    """``autoopt.diagnose``'s FLOP count of one step (per dtype, against the measured peak),
    for a step time of 1 s: the rows set their own. Under autocast when ``low``."""
    workload = Workload(model, args, None, device, True, None, lambda out, _: loss_of(out,
                                                                                      target))
    with autocast(device, low):
        return step_flops(workload, 1.0)


def run_model(name: str, batch: int, seq: int, rounds: int, runners: list[str],
              device: torch.device, apply_steps: int, params: dict[str, int]) -> list[Row]:
    case = CASES[name]
    torch.manual_seed(0)
    model = case.build().to(device).train()
    params[name] = sum(p.numel() for p in model.parameters())
    args, target = inputs(name, case, model, batch, seq, device)
    steps: dict[str, Callable[[], None]] = {}
    rows: dict[str, Row] = {}
    flops: dict[str, StepFlops | None] = {}

    def say(what: str) -> None:
        print(f"[{name} b{batch}x{seq}] {what}", flush=True)

    for runner in runners:
        row = rows[runner] = Row(name, runner)
        say(f"{runner}: setting up")
        start = time.perf_counter()
        try:
            step, row.flops = setup(runner, model, args, target, device, flops, row,
                                    apply_steps, say)
            step()  # warm-up: compilation, autotuning, allocator
            step()
        except Exception as exc:  # noqa: BLE001 - a row that says why, not a crash
            row.note = f"failed: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
            say(row.note)
            continue
        row.setup_s = time.perf_counter() - start
        steps[runner] = step
    for r in range(rounds):
        say(f"round {r + 1}/{rounds}")
        for runner, step in steps.items():
            start = time.perf_counter()
            step()
            rows[runner].samples.append(time.perf_counter() - start)
    say("peak memory")
    for runner, step in steps.items():
        rows[runner].memory = peak_memory(step, device)
    for row in rows.values():
        if row.samples:
            row.step_s = statistics.median(row.samples)
            if row.flops is not None:  # against peaks the step does not beat (MFU <= 100%)
                row.flops = held_to_peak(dataclasses.replace(row.flops, step_s=row.step_s),
                                         device)
    for row in rows.values():
        eager = rows.get("eager fp32" + (_ADAMW if row.runner.endswith(_ADAMW) else ""))
        if eager is not None and eager.step_s and row.step_s:
            row.speedup = eager.step_s / row.step_s
    return list(rows.values())


def setup(runner: str, model: nn.Module, args: tuple[torch.Tensor, ...], target: torch.Tensor,
          device: torch.device, flops: dict[str, StepFlops | None], row: Row,
          apply_steps: int, say: Callable[[str], None],
          ) -> tuple[Callable[[], None], StepFlops | None]:
    """The runner's step, and the FLOPs its MFU is counted from (counted once per precision
    on the eager model; autoopt's bf16 graphs by the share of ops they run in bf16)."""
    low = "autocast" in runner
    key = "bf16" if low else "fp32"
    if key not in flops:
        say(f"counting FLOPs ({key})")
        flops[key] = count_flops(model, args, target, device, low=low)
    if runner == "eager fp32" + _ADAMW:
        mine = copy.deepcopy(model)  # its updates move the copy's weights, not the others'
        return step_of(mine, args, target, device, optimizer=adamw(mine)), flops[key]
    if runner.startswith("eager"):
        return step_of(model, args, target, device, low), flops[key]
    if runner == "autoopt apply" + _ADAMW:
        say(f"diagnose with AdamW, then apply ({apply_steps} steps each)")
        diagnosis = autoopt.diagnose(model, args, training=True, steps=apply_steps,
                                     loss_fn=lambda out, _: loss_of(out, target),
                                     optimizer=adamw(model))
        result = diagnosis.apply(steps=apply_steps)
        row.note = f"applied: {', '.join(result.applied)}" + "".join(
            f"; {n}" for n in result.notes)
        # The step as apply measured it: the optimized module, its new optimizer, and the
        # whole-step remedies it kept (a copy of each, as diagnose runs them).
        workload = Workload(result.optimized, args, None, device, True, None,
                            lambda out, _: loss_of(out, target), result.optimizer,
                            result.step_options)
        workload.model.train()  # as Workload.running() leaves a copy
        feed = workload.batches()

        def step() -> None:
            workload.step(feed)  # synchronizes the device
        counted = flops[key]
        if any(c.precision is not None and c.precision.low_ops
               for c in result.optimized.report.captures):
            counted = count_flops(result.optimized, args, target, device)
        return step, counted
    if runner == "compile autocast bf16":
        torch._dynamo.reset()
        return step_of(torch.compile(model), args, target, device, low=True), flops[key]
    if runner == "autoopt apply":
        say(f"diagnose, then apply ({apply_steps} steps each)")
        diagnosis = autoopt.diagnose(model, args, training=True, steps=apply_steps,
                                     loss_fn=lambda out, _: loss_of(out, target))
        result = diagnosis.apply(steps=apply_steps)
        fast = result.optimized
        row.note = f"applied: {', '.join(result.applied)}" + "".join(
            f"; {n}" for n in result.notes)
    else:
        options = {"precision": "bf16"} if runner == "autoopt bf16" else {}
        fast = autoopt.optimize(model, args, training=True, **options)
        row.note = describe(fast)
    counted = flops[key]
    if getattr(fast, "report", None) is not None and any(
            c.precision is not None and c.precision.low_ops for c in fast.report.captures):
        say("counting FLOPs (autoopt's precision)")
        counted = count_flops(fast, args, target, device)
    return step_of(fast, args, target, device), counted


def describe(fast: nn.Module) -> str:
    """What autoopt did, briefly: capture, backend, precision."""
    report = getattr(fast, "report", None)
    if report is None:
        return ""
    parts = []
    for c in report.captures:
        parts.append(c.method)
        parts += [b.describe() for b in c.backends]
        if c.precision is not None:
            parts.append(c.precision.lines()[0])
    parts += [w for w in report.warnings if w.startswith("precision=")]
    return "; ".join(dict.fromkeys(parts))


def table(rows: list[Row], sizes: dict[str, tuple[int, int]], params: dict[str, int],
          threads: int, command: str, rounds: int, device: torch.device,
          load: str) -> str:
    title, machine = heading("Training step", device)
    lines = [
        title, "",
        f"`{command}` — {machine}, {threads} thread(s), torch {torch.__version__}, "
        f"transformers {transformers.__version__}, Python {platform.python_version()}; "
        f"load while it ran: {load}. A step is forward, fp32 cross-entropy, backward and "
        f"`zero_grad(set_to_none=True)`, no optimizer update (the `+ AdamW` rows: with "
        f"`torch.optim.AdamW`'s update, their speed-up over `eager fp32 + AdamW`); medians of "
        f"{rounds} interleaved "
        f"round(s) after two warm-up steps. MFU: forward+backward FLOPs "
        f"(`torch.utils.flop_counter`, per compute dtype, as `autoopt.diagnose`) over the "
        f"step time, against the cost model's measured GEMM peak in that dtype. Peak memory: "
        + ("`max_memory_allocated` during a step, weights included."
           if device.type == "cuda" else "resident memory's growth during a step (the "
           "activations and gradients; allocator reuse makes it approximate).")
        + " Setup: optimize or compile, plus the two warm-up steps.", "",
        "| model (sizes) | runner | step ms | MFU | peak memory MiB | vs eager fp32 | "
        "setup s |", "|---|---|---|---|---|---|---|"]
    notes = []
    for r in rows:
        batch, seq = sizes[r.model]
        shape = f"batch {batch}, {seq}x{seq}" if not CASES[r.model].tokens else \
            f"batch {batch}, seq {seq}"
        label = f"{r.model} ({params[r.model] / 1e6:.0f}M; {shape})"
        if r.step_s is None:
            lines.append(f"| {label} | {r.runner} | - | - | - | - | - |")
        else:
            mfu = f"{r.flops.mfu:.1%} ({r.flops.precision})" if r.flops else "-"
            memory = f"{r.memory / 2**20:.0f}" if r.memory is not None else "-"
            setup_s = f"{r.setup_s:.0f}" if r.setup_s is not None else "-"
            speedup = f"{r.speedup:.2f}×" if r.speedup is not None else "-"  # eager failed
            lines.append(f"| {label} | {r.runner} | {r.step_s * 1e3:.1f} | {mfu} | {memory} | "
                         f"{speedup} | {setup_s} |")
        if r.note:
            notes.append(f"- {r.model}, {r.runner}: {r.note}")
    return "\n".join(lines + [""] + notes) + "\n"


@dataclass
class Validation:
    model: str
    runner: str
    first_s: float = 0.0  # the first validation (autoopt: its capture)
    later_s: float = 0.0  # the median of the later ones (autoopt: each rebuilds)
    captures: int = 0
    rebuilds: int = 0


def validate_loop(name: str, batch: int, seq: int, rounds: int, val_batches: int,
                  device: torch.device) -> list[Validation]:
    """Train a step (SGD update), then validate ``val_batches`` calls, ``rounds`` times, for
    eager and autoopt from the same weights; each validation's seconds."""
    case = CASES[name]
    torch.manual_seed(0)
    model = case.build().to(device).train()
    args, target = inputs(name, case, model, batch, seq, device)
    validation = [inputs(name, case, model, batch, seq, device)[0] for _ in range(val_batches)]
    rows = []
    for runner in ("eager fp32", "autoopt fp32"):
        net = copy.deepcopy(model)
        if runner.startswith("autoopt"):
            print(f"[{name} b{batch}x{seq}] {runner}: optimizing", flush=True)
            net = autoopt.optimize(net, args, training=True)
        optimizer = torch.optim.SGD(net.parameters(), lr=1e-4)
        seconds = []
        for r in range(rounds):
            net.train()
            loss_of(net(*args), target).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            net.eval()
            start = time.perf_counter()
            with torch.no_grad():
                for batch_args in validation:
                    net(*batch_args)
            sync(device)
            seconds.append(time.perf_counter() - start)
            print(f"[{name} b{batch}x{seq}] {runner}: validation {r + 1}/{rounds} "
                  f"{seconds[-1]:.3f} s", flush=True)
        row = Validation(name, runner, seconds[0], statistics.median(seconds[1:] or seconds))
        report = getattr(net, "report", None)
        if report is not None:
            row.captures = len(report.captures)
            row.rebuilds = sum(c.rebuilds for c in report.captures)
        rows.append(row)
    return rows


def validation_table(rows: list[Validation], sizes: dict[str, tuple[int, int]], threads: int,
                     command: str, rounds: int, val_batches: int, device: torch.device,
                     load: str) -> str:
    eager = {r.model: r.later_s for r in rows if r.runner.startswith("eager")}
    lines = [f"## Train + validate ({device.type.upper()})", "",
             f"`{command}`: {platform.processor() or platform.machine()}, {threads} thread(s), "
             f"torch {torch.__version__}, {load}. {rounds} rounds of a training step (SGD "
             f"update), then {val_batches} validation calls under `no_grad` in eval mode. "
             f"autoopt's inference graph goes stale at each update: the first validation "
             f"captures it, each later one rebuilds it from its exported graph (no export, no "
             f"backend measurement) before its first call.", "",
             "| model | runner | first validation (s) | later, median (s) | later / eager's | "
             "graphs captured | rebuilds |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        batch, seq = sizes[r.model]
        over = f"{r.later_s / eager[r.model]:.2f}x" if eager.get(r.model) else ""
        lines.append(f"| {r.model} (batch {batch}, {seq}) | {r.runner} | {r.first_s:.3f} | "
                     f"{r.later_s:.3f} | {over} | {r.captures or ''} | {r.rebuilds or ''} |")
    return "\n".join(lines) + "\n"


@contextlib.contextmanager
def load_watch() -> Iterator[list[str]]:
    """The 1-minute load average at the start and the end (``os.getloadavg``)."""
    seen = [f"{os.getloadavg()[0]:.2f}"]
    yield seen
    seen.append(f"{os.getloadavg()[0]:.2f}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    parser.add_argument("--models", default=",".join(CASES))
    parser.add_argument("--runners", default=",".join(RUNNERS),
                        help=f"comma-separated, of {', '.join(RUNNERS)}")
    parser.add_argument("--full", action="store_true",
                        help="the issue's sizes (the default on CUDA)")
    parser.add_argument("--batch", type=int, help="batch for every model")
    parser.add_argument("--seq", type=int, help="sequence length (image side for resnet50)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--apply-steps", type=int, default=5,
                        help="steps diagnose runs before and after apply")
    parser.add_argument("--apply-models", default=None,
                        help="models the 'autoopt apply' runner runs on (default: all on a "
                             "GPU; resnet50, the issue's case, on a CPU: diagnose and apply "
                             "take minutes a model there)")
    parser.add_argument("--threads", type=int, default=None, help="CPU threads (default all)")
    parser.add_argument("--validate", type=int, default=0, metavar="N",
                        help="time N rounds of train step + validation instead (see above)")
    parser.add_argument("--val-batches", type=int, default=10,
                        help="validation calls per round (--validate)")
    parser.add_argument("--write", action="store_true", help="update docs/benchmarks.md")
    parser.add_argument("--out", type=Path, help="also write the table to this file (after "
                        "each model, so a run stopped early keeps the models done)")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print(f"--device {args.device}: no CUDA GPU here (torch.cuda.is_available() is False;"
              f" torch {torch.__version__}, CUDA build {torch.version.cuda}); run on a GPU "
              f"machine or use --device cpu", file=sys.stderr)
        return 2
    models = [m for m in args.models.split(",") if m]
    runners = [r.strip() for r in args.runners.split(",") if r.strip()]
    unknown = sorted(set(models) - set(CASES)) + sorted(set(runners) - set(RUNNERS))
    if unknown:
        parser.error(f"unknown model(s)/runner(s) {unknown}; models are {list(CASES)}, "
                     f"runners {list(RUNNERS)}")
    if "eager fp32" not in runners:
        runners.insert(0, "eager fp32")  # the speed-ups are over it
    if args.threads:
        torch.set_num_threads(args.threads)
    full = args.full or device.type == "cuda"
    sizes = {m: (args.batch or (CASES[m].full if full else CASES[m].cpu)[0],
                 args.seq or (CASES[m].full if full else CASES[m].cpu)[1]) for m in models}
    command = ("python bench/training.py " + shlex.join(sys.argv[1:] if argv is None else argv)
               ).strip()
    apply_models = (args.apply_models.split(",") if args.apply_models is not None
                    else models if device.type == "cuda" else ["resnet50"])
    if args.validate:
        found: list[Validation] = []
        with load_watch() as load:
            for name in models:
                found += validate_loop(name, *sizes[name], args.validate, args.val_batches,
                                       device)
        publish(validation_table(found, sizes, torch.get_num_threads(), command,
                                 args.validate, args.val_batches, device,
                                 f"1-min load average {load[0]} at the start, {load[1]} at "
                                 f"the end"), write=args.write, out=args.out)
        return 0
    rows: list[Row] = []
    params: dict[str, int] = {}
    with load_watch() as load:
        for name in models:
            mine = [r for r in runners if not r.startswith("autoopt apply")
                    or name in apply_models]
            done = {row.runner: row for row in run_model(name, *sizes[name], args.rounds,
                                                           mine, device, args.apply_steps,
                                                           params)}
            rows += [done.get(runner) or Row(name, runner, note=(
                "not run (--apply-models): diagnose runs the step before and after, with a "
                "profile and a roofline of every node, and optimize once or twice: minutes a "
                "model" + (" on this CPU" if device.type == "cpu" else "")))
                for runner in runners if runner in done or runner.startswith("autoopt apply")]
            gc.collect()
            if args.out is not None:  # what is done so far, should the run be stopped
                args.out.write_text(table(rows, sizes, params, torch.get_num_threads(),
                                          command, args.rounds, device,
                                          f"1-min load average {load[0]} at the start"))
    section = table(rows, sizes, params, torch.get_num_threads(), command, args.rounds, device,
                    f"1-min load average {load[0]} at the start, {load[1]} at the end")
    publish(section, write=args.write, out=args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
