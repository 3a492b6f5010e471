"""Training under a memory budget: saved-activation bytes and step time at 100/50/25% budgets.

    python bench/memory.py --write                 # CPU: keep/recompute plans
    python bench/memory.py --device cuda --out D   # GPU: keep/offload/recompute, peak memory

A GPT-2-style model (transformers ``GPT2LMHeadModel`` from a small config, random weights, no
dropout so every runner computes the same step). Runners: eager; ``autoopt.optimize(...,
training=True, memory_budget=B)`` for B = 100%, 50%, 25% of the saved activations the
captured graph needs without a plan; and eager with ``torch.utils.checkpoint`` (non-reentrant)
on every block. Saved bytes are counted through saved-tensor hooks around the forward
(parameters excluded; what offload or checkpoint take over is not on the device). Step =
forward + backward; median over interleaved rounds, one intra-op thread. On a GPU the peak
``torch.cuda.max_memory_allocated`` of a step is added. ``--write`` updates docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import copy
import platform
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import transformers
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cost_model_accuracy import publish  # noqa: E402

import autoopt  # noqa: E402
from autoopt.planning.segments import MODES  # noqa: E402
from autoopt.runtime.offload import saved_bytes_counter  # noqa: E402

transformers.logging.set_verbosity_error()

FRACTIONS = (1.0, 0.5, 0.25)


def gpt2(device: str, layers: int = 6, width: int = 256, seq: int = 256, batch: int = 4,
         ) -> tuple[nn.Module, torch.Tensor]:
    config = transformers.GPT2Config(vocab_size=2048, n_embd=width, n_layer=layers,
                                     n_head=width // 64, n_positions=seq, resid_pdrop=0.0,
                                     embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).to(device).train()
    ids = torch.randint(0, config.vocab_size, (batch, seq), device=device)
    return model, ids


def _state(*modules: Any) -> set[int]:
    return {t.untyped_storage().data_ptr() for m in modules
            for t in (*m.parameters(), *m.buffers())}


class Runner:
    """One way to run a training step, with what it reports."""

    def __init__(self, label: str, call: Callable[[torch.Tensor], Any], owner: nn.Module,
                 state: set[int], budget: int | None = None, plan: Any = None) -> None:
        self.label, self.call, self.owner, self.state = label, call, owner, state
        self.budget, self.plan = budget, plan
        self.times: list[float] = []
        self.saved = 0
        self.peak = 0
        self.loss = 0.0

    def step(self, ids: torch.Tensor, count: bool = False) -> float:
        self.owner.zero_grad(set_to_none=True)
        cuda = ids.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        start = time.perf_counter()
        if count:
            with saved_bytes_counter(self.state) as counter:
                out = self.call(ids)
            self.saved = counter.bytes
        else:
            out = self.call(ids)
        logits = out.logits if hasattr(out, "logits") else out[0]
        loss = nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(),
                                           ids[:, 1:].flatten())
        loss.backward()
        if cuda:
            torch.cuda.synchronize()
            self.peak = max(self.peak, torch.cuda.max_memory_allocated() - base)
        self.loss = float(loss.detach())
        return time.perf_counter() - start


def runners(model: nn.Module, ids: torch.Tensor, device: str) -> list[Runner]:
    found = [Runner("eager", lambda x: model(x), model, _state(model))]
    modes = None  # the device's default: all on a GPU, all but offload on a CPU
    # The need: what the captured graph saves without a plan (the plan at a budget it meets).
    probe = autoopt.optimize(model, (ids,), training=True, memory_budget=2**50,
                             memory_modes=modes)
    need = probe.report.captures[0].memory_plan.unconstrained_bytes
    for fraction in FRACTIONS:
        budget = int(need * fraction)
        fast = autoopt.optimize(model, (ids,), training=True, memory_budget=budget,
                                memory_modes=modes)
        graphs = [s.graph for s in fast.specializations]
        found.append(Runner(f"autoopt {fraction:.0%}", fast, fast.module,
                            _state(fast.module, *graphs), budget,
                            fast.report.captures[0].memory_plan))
    checkpointed = copy.deepcopy(model)
    with warnings.catch_warnings():  # renamed in later transformers; same behaviour
        warnings.simplefilter("ignore", FutureWarning)
        checkpointed.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": False})
    found.append(Runner("checkpoint every block", lambda x: checkpointed(x), checkpointed,
                        _state(checkpointed)))
    return found


def run(device: str, rounds: int, threads: int, **size: int,
        ) -> tuple[list[Runner], dict[str, Any]]:
    torch.set_num_threads(threads)
    model, ids = gpt2(device, **size)
    found = runners(model, ids, device)
    for r in found:
        r.step(ids, count=True)  # warm-up, and the saved-byte count
    for _ in range(rounds):
        for r in found:  # interleaved, so drift hits every runner alike
            r.times.append(r.step(ids))
    facts = {"layers": model.config.n_layer, "width": model.config.n_embd,
             "seq": ids.shape[1], "batch": ids.shape[0],
             "params": sum(p.numel() for p in model.parameters())}
    return found, facts


def table(found: list[Runner], facts: dict[str, Any], device: str, threads: int,
          command: str) -> str:
    eager = statistics.median(found[0].times)
    full = statistics.median(found[-1].times) - eager
    cuda = device == "cuda"
    where = torch.cuda.get_device_name() if cuda else platform.machine()
    lines = [f"## Training memory budget ({'GPU' if cuda else 'CPU'})", "",
             f"Command: `{command}`  ",
             f"Machine: {where}, {threads} thread(s), torch {torch.__version__}. GPT-2 "
             f"({facts['layers']} layers, width {facts['width']}, {facts['params'] / 1e6:.1f} M "
             f"parameters), batch {facts['batch']} x {facts['seq']} tokens, no dropout, random "
             f"weights. Saved = bytes autograd keeps on the device after forward, counted "
             f"through saved-tensor hooks; step = forward + backward, median of "
             f"{len(found[0].times)} interleaved rounds; overhead = step - eager step."
             + (" Peak = max_memory_allocated during a step above what was allocated before."
                if cuda else ""), "",
             "| runner | budget | saved MiB | planned peak MiB | plan (" + "/".join(MODES) + ") "
             "| predicted added ms | step ms | overhead ms | loss |"
             + (" peak MiB |" if cuda else ""),
             "|---|---|---|---|---|---|---|---|---|" + ("---|" if cuda else "")]
    for r in found:
        step = statistics.median(r.times)
        plan = r.plan
        counts = ("/".join(str(plan.count(m)) for m in MODES) + f" ({plan.method})"
                  if plan is not None else "-")
        budget = f"{r.budget / 2**20:.1f} MiB" if r.budget is not None else "-"
        planned = f"{plan.peak_bytes / 2**20:.1f}" if plan is not None else "-"
        predicted = f"{plan.added_seconds * 1e3:.1f}" if plan is not None else "-"
        lines.append(f"| {r.label} | {budget} | {r.saved / 2**20:.1f} | {planned} | {counts} | "
                     f"{predicted} | "
                     f"{step * 1e3:.1f} | {(step - eager) * 1e3:+.1f} | {r.loss:.4f} |"
                     + (f" {r.peak / 2**20:.0f} |" if cuda else ""))
    half = statistics.median(next(r for r in found if r.label == "autoopt 50%").times)
    whole = statistics.median(next(r for r in found if r.label == "autoopt 100%").times)
    overhead, own = half - eager, half - whole
    verdict = "met" if max(overhead, own) <= full / 2 else "not met"
    lines += ["", f"Goal (50% budget: overhead at most half of checkpointing every block's "
              f"{full * 1e3:.1f} ms, i.e. {full / 2 * 1e3:.1f} ms): {verdict}; overhead "
              f"{overhead * 1e3:.1f} ms over eager, {own * 1e3:.1f} ms over autoopt at 100%. "
              f"Checkpointing's saved bytes exclude what each block regenerates in backward; "
              f"the planned peak of autoopt's plans includes it."]
    return "\n".join(lines) + "\n"


def gpu_rows(rounds: int = 5) -> list[str]:
    """The GPU table, for bench/gpu_check.py: GPT-2 small's shape (12 layers, width 768) at
    batch 8 x 1024 tokens, where saved activations are GiBs."""
    found, facts = run("cuda", rounds, 1, layers=12, width=768, seq=1024, batch=8)
    return table(found, facts, "cuda", 1, "python bench/gpu_check.py --out OUT").splitlines()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--write", action="store_true", help="update docs/benchmarks.md")
    parser.add_argument("--out", type=Path, help="also write memory.md into this folder")
    args = parser.parse_args()
    found, facts = run(args.device, args.rounds, args.threads)
    command = ("python bench/memory.py " + " ".join(sys.argv[1:])).strip()
    section = table(found, facts, args.device, args.threads, command)
    publish(section, write=args.write)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "memory.md").write_text(section)
    return 0


if __name__ == "__main__":
    sys.exit(main())
