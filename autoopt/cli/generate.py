"""``autoopt generate``: decode with a causal language model, eager ``model.generate`` against
``OptimizedModule.generate`` on the same random prompt, interleaved: time to first token,
decode tokens/s, whether the tokens are the same, the weights' size."""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from autoopt.cli.common import add_common_arguments, set_threads
from autoopt.cli.names import PRECISIONS
from autoopt.cli.progress import output, stage
from autoopt.errors import ConfigError

if TYPE_CHECKING:  # imported where used: building the parsers (--help) imports no torch
    import torch


def add_parser(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("generate", help="decode with a causal LM: eager generate against "
                                              "autoopt's, tokens/s and time to first token")
    parser.add_argument("model", metavar="MODEL", help="package.module:factory or "
                        "path/to/file.py:Name returning a transformers causal LM")
    parser.add_argument("--prompt-len", type=int, default=32, help="prompt tokens (default 32)")
    parser.add_argument("--new", type=int, default=128, help="new tokens (default 128)")
    parser.add_argument("--batch", type=int, default=1, help="prompts per call (default 1)")
    parser.add_argument("--precision", choices=PRECISIONS, default=None,
                        help="autoopt's precision (int8: int8 weights; default fp32)")
    parser.add_argument("--rounds", type=int, default=3,
                        help="interleaved timing rounds; medians are reported (default 3)")
    add_common_arguments(parser)


@dataclass
class GenerationTiming:
    """Medians over rounds: time to first token (until the first token's logits), the
    whole call, and decode tokens/s over the tokens after the first."""

    first_token_s: float
    total_s: float
    batch: int
    new_tokens: int

    @property
    def decode_tokens_per_s(self) -> float:
        decode = self.total_s - self.first_token_s
        return self.batch * (self.new_tokens - 1) / decode if decode > 0 else float("nan")


class _FirstToken:
    """A logits processor that notes when it is first called: the prompt step is done and
    the first token is being chosen (time to first token, within the very call timed)."""

    def __init__(self) -> None:
        self.at: float | None = None

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.at is None:
            import torch

            if scores.is_cuda:
                torch.cuda.synchronize(scores.device)
            self.at = time.perf_counter()
        return scores


# Greedy, and every call makes all its new tokens: no end-of-sequence token stops it, as
# llama.cpp's own benchmark ignores it. Not ``min_new_tokens``: its two logits processors
# (a copy of the logits, a mask over the vocabulary) cost 1.6 ms a token on a Llama-style
# model's 32000 tokens, an eighth of an int8 decode step.
TIMED = {"eos_token_id": None, "do_sample": False}


def time_generation(runners: dict[str, Callable[..., Any]], ids: torch.Tensor, new: int,
                    rounds: int) -> dict[str, GenerationTiming]:
    """Each runner is called like ``generate(ids, max_new_tokens=..., **TIMED)``: greedy,
    every runner producing ``new`` tokens; interleaved rounds. One call gives both figures
    (a separate one-token call would size a static cache differently)."""
    from transformers import LogitsProcessorList

    for generate in runners.values():  # warm-up: allocations, lazy imports, first captures
        generate(ids, max_new_tokens=new, **TIMED)
    first: dict[str, list[float]] = {name: [] for name in runners}
    total: dict[str, list[float]] = {name: [] for name in runners}
    for _ in range(rounds):
        for name, generate in runners.items():
            mark = _FirstToken()
            start = time.perf_counter()
            generate(ids, max_new_tokens=new, logits_processor=LogitsProcessorList([mark]),
                     **TIMED)
            total[name].append(time.perf_counter() - start)
            first[name].append((mark.at or start) - start)
    return {name: GenerationTiming(statistics.median(first[name]),
                                   statistics.median(total[name]), ids.shape[0], new)
            for name in runners}


def run(args: argparse.Namespace) -> int:
    import torch

    from autoopt.api import optimize
    from autoopt.cli.loading import load_model
    from autoopt.onnx.writer import weight_bytes

    if min(args.prompt_len, args.new, args.batch, args.rounds) < 1:
        raise ConfigError("--prompt-len, --new, --batch and --rounds must be at least 1")
    set_threads(args.threads)
    stage(f"loading {args.model}")
    model = load_model(args.model).eval()
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    if not hasattr(model, "generate") or not vocab:
        raise ConfigError(f"{args.model} is not a transformers causal language model (it has "
                          f"no generate method or config.vocab_size)")
    ids = torch.randint(1, vocab, (args.batch, args.prompt_len))
    stage("optimizing: capture, passes, verification")
    fast = optimize(model, (ids,), precision=args.precision)
    stage("generating once: the prompt and decode steps are captured")
    started = time.perf_counter()
    tokens = fast.generate(ids, max_new_tokens=args.new, **TIMED)
    warm = time.perf_counter() - started
    eager_tokens = model.generate(ids, max_new_tokens=args.new, **TIMED)
    stage(f"timing {args.rounds} interleaved rounds")
    timings = time_generation({"eager": model.generate, "autoopt": fast.generate}, ids,
                              args.new, args.rounds)
    output(f"prompt {args.prompt_len} tokens, {args.new} new, batch {args.batch}, "
           f"{torch.get_num_threads()} thread(s); greedy; autoopt precision "
           f"{args.precision or 'fp32'}")
    for name, t in timings.items():
        output(f"{name:8s} time to first token {t.first_token_s * 1e3:8.1f} ms   decode "
               f"{t.decode_tokens_per_s:8.1f} tokens/s   whole call {t.total_s * 1e3:8.1f} ms")
    ratio = timings["autoopt"].decode_tokens_per_s / timings["eager"].decode_tokens_per_s
    output(f"decode speedup over eager: {ratio:.2f}x")
    same = torch.equal(tokens, eager_tokens)
    output(f"tokens: {'the same as eager' if same else 'differ from eager'}"
           + ("" if same or args.precision is None else f" (precision {args.precision})"))
    output(f"weights: {weight_bytes(model) / 2**20:.1f} MiB; first generate (captures "
           f"included): {warm:.1f} s")
    return 0
