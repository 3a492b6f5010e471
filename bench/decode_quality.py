"""Quantized decoding's quality on a trained model: perplexity and next-token agreement of
autoopt's bf16, int8 and int4 kernels beside llama.cpp's f16, Q8_0 and Q4_0 on the same weights.

On random weights the two best logits of a step are nearly tied, so whether a quantized model
ranks eager's token first measures near-ties more than quality (the same int4 weights of the
bench's random Llama-style model agreed with eager on 41% or on 18% of 256 steps as each
group's range was taken from its extremes or searched for the least squared error). Here the
model is a small Llama trained on a text Python ships (``pydoc_data.topics``, the help()
topics: 466 KB of English and code, the same for every install of a Python version), one byte
per token, to a held-out loss near 1.6 nats per byte; the weights are cached on disk, so later
runs skip the training.

Every runner decodes the same held-out windows teacher-forced: a prompt from the text, then
each step fed the text's next byte (``bench/generate.py``'s ``_Forced`` logits processor,
through the runner's own ``generate``: autoopt's decode-step graphs, llama.cpp's eval of one
token). Per runner: perplexity of the text's bytes, the fraction of steps whose first-ranked
byte is eager fp32's, and the largest logit error against eager's. autoopt rows name the kernel
(``pass_options={"precision": {"kernel": ..., "force": True}}``: every linear on that kernel,
its speed not measured, since the decode bench's speed rows choose by measurement on a larger
model); llama.cpp rows are "pure" files (every matrix in the type, ``bench/gguf_file.py``).

    python bench/decode_quality.py --threads 2 --write
"""

from __future__ import annotations

import argparse
import hashlib
import math
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import transformers
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gguf_file  # noqa: E402
from cost_model_accuracy import heading, publish  # noqa: E402
from generate import _Forced  # noqa: E402

import autoopt  # noqa: E402
from autoopt.cli.generate import TIMED  # noqa: E402
from autoopt.cost_model.cache import default_cache_dir  # noqa: E402

transformers.logging.set_verbosity_error()

# The trained model: 4 layers of width 256, grouped-query attention, one byte per token
# (widths that are multiples of 32, as int4's groups and the block kernels need).
CONFIG = dict(vocab_size=256, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
              num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=512,
              bos_token_id=0, eos_token_id=0, pad_token_id=0)
HELD_OUT = 0.1  # the text's last tenth: never trained on
# autoopt's rows: (precision, kernel or None for the precision's own). bf16 twice: cast to
# bf16 (a CPU with a fast bf16 GEMM), and as fp16 weights with fp32 activations (the
# ``weight_only`` form optimize picks for a decoder where bf16 GEMMs are slow).
AUTOOPT = (("fp32", None), ("bf16", None), ("bf16", "fp16 weights"), ("int8", "int8_blocks"),
           ("int8", "int8_weight"), ("int8", "int8"), ("int4", "int4_blocks"), ("int4", "int4"))


def corpus() -> bytes:
    """The text: Python's help() topics, in a fixed order."""
    import pydoc_data.topics as topics

    return "".join(topics.topics[k] for k in sorted(topics.topics)).encode()


def train(text: bytes, steps: int, batch: int = 16, length: int = 128,
          log: Callable[[str], None] = print) -> tuple[nn.Module, dict[str, float]]:
    """A Llama of ``CONFIG`` trained on ``text`` less its held-out tail (AdamW, warmup then
    cosine decay, seeded): the model in eval mode and what the training did."""
    torch.manual_seed(0)
    data = torch.tensor(list(text), dtype=torch.long)
    seen = data[:int(len(data) * (1 - HELD_OUT))]
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01,
                                  betas=(0.9, 0.95))
    start = time.perf_counter()
    first = last = float("nan")
    for step in range(steps):
        rate = 3e-3 * min(1.0, (step + 1) / 20) * (
            0.1 + 0.45 * (1 + math.cos(math.pi * step / steps)))
        for group in optimizer.param_groups:
            group["lr"] = rate
        starts = torch.randint(0, len(seen) - length, (batch,))
        x = torch.stack([seen[i:i + length] for i in starts])
        loss = model(x, labels=x).loss
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        first = loss.item() if step == 0 else first
        last = loss.item()
        if step % 50 == 0 or step == steps - 1:
            log(f"training step {step + 1}/{steps}: loss {last:.3f} "
                f"({time.perf_counter() - start:.0f} s)")
    model.eval()
    return model, {"steps": steps, "first_loss": first, "last_loss": last,
                   "seconds": time.perf_counter() - start}


def trained(steps: int, folder: Path | None = None,
            log: Callable[[str], None] = print) -> tuple[nn.Module, dict[str, float]]:
    """``train``'s model, from the cache folder where an earlier run with the same text,
    configuration, steps and torch version left it."""
    text = corpus()
    key = hashlib.sha256(repr((text, sorted(CONFIG.items()), steps, torch.__version__,
                               transformers.__version__)).encode()).hexdigest()[:16]
    path = (folder or default_cache_dir() / "bench") / f"decode-quality-{key}.pt"
    if path.exists():
        saved = torch.load(path, weights_only=True)
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG)).eval()
        model.load_state_dict(saved["weights"])
        log(f"trained model read from {path}")
        return model, {**saved["training"], "cached": True}
    log(f"training the model ({steps} steps; cached afterwards in {path.parent})")
    model, training = train(text, steps, log=log)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"weights": model.state_dict(), "training": training}, path)
    return model, {**training, "cached": False}


def windows(count: int, prompt: int, new: int) -> list[torch.Tensor]:
    """``count`` stretches of ``prompt + new`` bytes, evenly spread over the held-out tail."""
    text = corpus()
    held = torch.tensor(list(text[int(len(text) * (1 - HELD_OUT)):]), dtype=torch.long)
    span = prompt + new
    stride = max(span, (len(held) - span) // max(count, 1))
    return [held[i:i + span][None] for i in range(0, stride * count, stride)
            if i + span <= len(held)][:count]


def forced_logits(generate: Callable[..., Any], window: torch.Tensor,
                  prompt: int) -> torch.Tensor:
    """The logits of each decode step of ``generate`` on ``window``'s prompt, every step fed
    the window's next byte: ``(new, vocab)``."""
    forced = _Forced(window)
    with torch.no_grad():
        generate(window[:, :prompt], max_new_tokens=window.shape[1] - prompt,
                 logits_processor=transformers.LogitsProcessorList([forced]), **TIMED)
    return torch.cat(forced.seen)


def scores(logits: torch.Tensor, reference: torch.Tensor,
           targets: torch.Tensor) -> dict[str, float]:
    """Perplexity of ``targets`` under ``logits``, and agreement and largest error against
    ``reference`` (all ``(steps, vocab)``)."""
    nll = torch.nn.functional.cross_entropy(logits.float(), targets)
    return {"perplexity": math.exp(float(nll)),
            "agreement": float((logits.argmax(-1) == reference.argmax(-1)).float().mean()),
            "error": float((logits.float() - reference.float()).abs().max())}


def runners(model: nn.Module, prompt: torch.Tensor, threads: int, context: int, folder: Path,
            llama_cpp: bool, log: Callable[[str], None] = print,
            rows: tuple[tuple[str, str | None], ...] = AUTOOPT,
            ) -> dict[str, Callable[..., Any] | str]:
    """Each runner's generate by label, or why it has none."""
    found: dict[str, Callable[..., Any] | str] = {"eager fp32": model.generate}
    for precision, kernel in rows:
        label = f"autoopt {precision}" + (f" ({kernel})" if kernel else "")
        log(f"{label}: optimize")
        options: dict[str, Any] = {"force": True, "min_agreement": 0.0}
        if kernel == "fp16 weights":
            options["weight_only"] = True
        elif kernel:
            options["kernel"] = kernel
        try:
            if precision == "fp32":
                fast = autoopt.optimize(model, (prompt,))
            else:
                fast = autoopt.optimize(model, (prompt,), precision=precision,
                                        pass_options={"precision": options})
        except autoopt.ConfigError as exc:
            found[label] = f"refused: {str(exc).splitlines()[0][:120]}"
            continue
        found[label] = fast.generate
    why = gguf_file.available() if llama_cpp else "--no-llama-cpp"
    for kind in gguf_file.TYPES:
        label = f"llama.cpp {kind}"
        if why:
            found[label] = f"skipped: {why}"
            continue
        log(f"{label}: write the file and load it")
        path = gguf_file.write(model, folder / f"quality-{kind}.gguf", kind)
        found[label] = gguf_file.Runner(path, threads, context).generate
    return found


def measure(model: nn.Module, count: int, prompt: int, new: int, threads: int,
            llama_cpp: bool = True, log: Callable[[str], None] = print,
            rows: tuple[tuple[str, str | None], ...] = AUTOOPT) -> list[dict[str, Any]]:
    """One row per runner (eager, ``rows`` of autoopt, llama.cpp's): its scores over
    ``count`` held-out windows, or why it has none."""
    spans = windows(count, prompt, new)
    with tempfile.TemporaryDirectory(prefix="autoopt-quality-") as folder:
        found = runners(model, spans[0][:, :prompt], threads, prompt + new + 8, Path(folder),
                        llama_cpp, log, rows)
        targets = torch.cat([w[0, prompt:] for w in spans])
        logits: dict[str, torch.Tensor] = {}
        table = []
        for label, generate in found.items():
            if isinstance(generate, str):
                table.append({"runner": label, "failed": generate})
                continue
            log(f"{label}: {len(spans)} window(s) of {new} forced steps")
            start = time.perf_counter()
            logits[label] = torch.cat([forced_logits(generate, w, prompt) for w in spans])
            row = {"runner": label, "seconds": time.perf_counter() - start,
                   **scores(logits[label], logits["eager fp32"], targets)}
            table.append(row)
    return table


def table(rows: list[dict[str, Any]], training: dict[str, Any], command: str, threads: int,
          count: int, prompt: int, new: int) -> str:
    title, machine = heading("Decoding quality on a trained model", torch.device("cpu"))
    params = sum(p.numel() for p in transformers.LlamaForCausalLM(
        transformers.LlamaConfig(**CONFIG)).parameters())
    lines = [
        title, "",
        f"`{command}` — {machine}, {threads} thread(s), torch {torch.__version__}, "
        f"transformers {transformers.__version__}. A Llama of {params / 1e6:.1f}M parameters "
        f"(4 layers of width 256, one byte per token) trained {training['steps']} steps on "
        f"Python's help() topics less their last tenth (loss {training['first_loss']:.2f} → "
        f"{training['last_loss']:.2f} nats per byte, {training['seconds']:.0f} s"
        f"{', read from the cache' if training.get('cached') else ''}). "
        f"{count} windows of the held-out tenth, each a {prompt}-byte prompt and {new} "
        f"teacher-forced decode steps ({count * new} steps per runner). Perplexity of the "
        f"text's next bytes; agreement = the fraction of steps whose first-ranked byte is "
        f"eager fp32's; largest logit error against eager fp32's logits. autoopt rows: every "
        f"linear on the named kernel (`force`), whatever its speed; bf16 alone: cast to "
        f"bf16, as on a CPU with a fast bf16 GEMM; bf16 (fp16 weights): the form optimize "
        f"picks for a decoder where bf16 GEMMs are slow. llama.cpp rows: pure files of the "
        f"same weights.", "",
        "| runner | perplexity | agreement with eager fp32 | largest logit error |",
        "|---|---|---|---|"]
    for r in rows:
        if "failed" in r:
            lines.append(f"| {r['runner']} | {r['failed']} | | |")
            continue
        lines.append(f"| {r['runner']} | {r['perplexity']:.3f} | {r['agreement']:.1%} | "
                     f"{r['error']:.3g} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--steps", type=int, default=300, help="training steps")
    parser.add_argument("--windows", type=int, default=32)
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--no-llama-cpp", action="store_true")
    parser.add_argument("--write", action="store_true", help="update docs/benchmarks.md")
    parser.add_argument("--out", type=Path, help="also write the table to this file")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, training = trained(args.steps)
    rows = measure(model, args.windows, args.prompt, args.new, args.threads,
                   not args.no_llama_cpp)
    command = "python bench/decode_quality.py " + " ".join(sys.argv[1:])
    publish(table(rows, training, command.strip(), args.threads, args.windows, args.prompt,
                  args.new), write=args.write, out=args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
