"""LLM decoding: eager ``generate``, the static-cache + ``torch.compile`` recipe, and autoopt's
``OptimizedModule.generate`` (fp32, int8 and int4 weights), in one run.

    python bench/generate.py --threads 1 --write             # the table in docs/benchmarks.md
    python bench/generate.py --models gpt2 --batches 1 --new 32 --rounds 1   # a quick look
    python bench/generate.py --device cuda --new 64 --out gen.md           # a GPU (bf16 rows)
    python bench/generate.py --models llama --batches 1 --cold              # + cold setup
    python bench/generate.py --models llama --int8-forced    # + int8 on every linear it may

Models (random weights, configs built in code, nothing downloaded): GPT-2 at the 124M shape
(12 layers, width 768) and a Llama-style decoder of ~100M parameters (RoPE, RMSNorm, SwiGLU,
grouped-query attention: 8 layers, width 768, 12 heads over 4 KV heads, vocabulary 32000).
Each: prompt 32 tokens, 128 new (no end-of-sequence token: every runner makes them all, as
llama.cpp's benchmark does, and no logits processor runs), greedy,
batch 1 and 8. Runners, interleaved per round, medians over rounds:

- ``eager``: ``model.generate`` (dynamic KV cache, transformers' default);
- ``compile``: transformers' documented recipe, ``generation_config.cache_implementation =
  "static"`` and ``model.forward = torch.compile(model.forward)``;
- ``llama.cpp f32/f16/Q8_0/Q4_0``: llama.cpp (llama-cpp-python, which pip builds from
  source for this CPU) on GGUF files of the same weights that ``gguf_file.py`` writes with
  llama.cpp's own ``gguf`` package, "pure" quantization; greedy over the last token's logits,
  with the same logits processors; batch 1 only, left out with ``--no-llama-cpp`` and skipped
  with the reason where llama-cpp-python is not installed;
- ``autoopt``: ``autoopt.optimize(model, (ids,)).generate(...)``, with ``precision="bf16"``
  (bf16 weights, oneDNN's packed bf16 linears where measured faster), ``precision="int8"``
  (each linear in int8 where its error fits, with the int8 kernel, dynamic or weight-only,
  that measures fastest, fp32 where that does) and ``precision="int4"`` (weight-only, groups
  of 32) on the CPU; with ``--int8-forced`` also ``autoopt int8 forced``:
  ``pass_options={"precision": {"force": True}}``, int8 wherever the error fits, its speed not
  measured. These rows pass ``min_agreement=0``: the precision is timed even where its
  next-token agreement would refuse it (random weights: nearly flat logits), and the
  agreement column says what it measured.

Columns: time to first token (until the first token's logits, within the timed call),
decode tokens/s (tokens after the first, per second of the call after the first token, times
the batch), the decode speedup over eager, the fraction of new tokens equal to eager's (and
for the low-precision runner, of eager's next tokens it ranks first given eager's prefix, and the
largest logit error over those steps against eager's), the
roofline: the weights' bytes each step reads, over the memory bandwidth measured here (a
large tensor's sum or matrix-vector products over it, the faster), as tokens/s; and setup:
optimize or compile and two calls, less a steady call, so every graph either one captures is
counted. ``--cold`` adds the setup of a new user: each runner set up again in a fresh process
with empty Inductor and autoopt caches (``TORCHINDUCTOR_CACHE_DIR``, ``XDG_CACHE_HOME``), less
a third, steady call.
"""

from __future__ import annotations

import argparse
import copy
import math
import os
import platform
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
import child_process  # noqa: E402
import gguf_file  # noqa: E402
from cost_model_accuracy import heading, publish  # noqa: E402

import autoopt  # noqa: E402
from autoopt.cli.generate import TIMED, time_generation  # noqa: E402
from autoopt.onnx.writer import weight_bytes  # noqa: E402

transformers.logging.set_verbosity_error()


def gpt2() -> nn.Module:
    config = transformers.GPT2Config(vocab_size=50257, n_embd=768, n_layer=12, n_head=12,
                                     n_positions=1024, bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(config).eval()


def llama() -> nn.Module:
    config = transformers.LlamaConfig(vocab_size=32000, hidden_size=768, intermediate_size=2048,
                                      num_hidden_layers=8, num_attention_heads=12,
                                      num_key_value_heads=4, max_position_embeddings=1024,
                                      bos_token_id=0, eos_token_id=0, pad_token_id=0)
    return transformers.LlamaForCausalLM(config).eval()


MODELS: dict[str, Callable[[], nn.Module]] = {"gpt2": gpt2, "llama": llama}


def bandwidth(device: torch.device) -> float:
    """Bytes/s of reading 512 MiB of fp32 at the current thread count: the faster of a sum
    over one tensor and matrix-vector products over 64 matrices of 8 MiB (the reads a decode
    step makes; on a 2-vCPU Intel Xeon VM one thread's GEMVs streamed 14 GB/s where its sum
    read 10.5, and llama.cpp's f32 rows measured 130-140% of a roofline from the sum), best of
    5 each."""
    big = torch.ones(128 * 2**20, device=device)
    matrices = list(big.view(64, 2048, 1024).unbind())
    x = torch.ones(1024, device=device)

    def gemvs() -> None:
        for m in matrices:
            torch.mv(m, x)

    best = float("inf")
    for read in (big.sum, gemvs):
        for _ in range(5):
            sync(device)
            start = time.perf_counter()
            read()
            sync(device)
            best = min(best, time.perf_counter() - start)
    return big.numel() * 4 / best


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def synced(generate: Callable[..., Any], device: torch.device) -> Callable[..., Any]:
    """``generate`` that returns once the device has finished (for wall-clock timing)."""
    def call(*args: Any, **kwargs: Any) -> Any:
        out = generate(*args, **kwargs)
        sync(device)
        return out
    return call


def read_per_step(model: nn.Module) -> int:
    """Bytes of weights one decode step reads: every parameter, except an embedding table
    that is not also the output head (a step reads one row of it)."""
    head = model.get_output_embeddings()
    head_weight = head.weight if head is not None else None
    skipped = {id(m.weight) for m in model.modules()
               if isinstance(m, nn.Embedding) and m.weight is not head_weight}
    return sum(p.numel() * p.element_size() for p in model.parameters()
               if id(p) not in skipped)


def agreement(tokens: torch.Tensor, eager: torch.Tensor, prompt: int) -> float:
    """The fraction of new tokens equal to eager's at the same position (1.0: the same
    sequences)."""
    new, reference = tokens[:, prompt:], eager[:, prompt:]
    if new.shape != reference.shape:
        return 0.0
    return float((new == reference).float().mean())


class _Forced(transformers.LogitsProcessor):
    """Teacher forcing through ``generate``: records each step's logits and makes the step
    choose eager's next token, so every step runs on eager's prefix."""

    def __init__(self, eager: torch.Tensor) -> None:
        self.eager = eager
        self.seen: list[torch.Tensor] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.seen.append(scores.detach().float().clone())
        forced = torch.full_like(scores, -math.inf)
        return forced.scatter_(1, self.eager[:, input_ids.shape[1], None], 0.0)


def next_token_agreement(generate: Callable[..., Any], model: nn.Module,
                         eager: torch.Tensor, prompt: int) -> tuple[float, float]:
    """The fraction of eager's new tokens that ``generate`` also ranks first given the same
    prefix (eager's), and the largest logit error there. Each step of the runner's own
    ``generate`` (its prompt and decode graphs, as the timed calls run them) is fed eager's
    tokens by a logits processor that records the step's logits and then forces eager's
    token. Unlike generated tokens, one differing token does not change every later one:
    with random weights the two best logits are close (a median gap of 0.07 against a spread
    of 0.55 on the Llama-style model), so greedy sequences part at the first near tie and the
    fraction of equal generated tokens measures where that happens."""
    new = eager.shape[1] - prompt
    logits = []
    with torch.no_grad():
        for run in (model.generate, generate):
            forced = _Forced(eager)
            run(eager[:, :prompt], max_new_tokens=new,
                logits_processor=transformers.LogitsProcessorList([forced]), **TIMED)
            logits.append(torch.stack(forced.seen, 1))
    reference, got = logits
    same = float((got.argmax(-1) == reference.argmax(-1)).float().mean())
    return same, float((got - reference).abs().max())


def compile_recipe(model: nn.Module) -> Callable[..., Any]:
    compiled = copy.deepcopy(model)
    compiled.generation_config.cache_implementation = "static"
    compiled.forward = torch.compile(compiled.forward)
    return compiled.generate


def set_up(label: str, model: nn.Module, ids: torch.Tensor,
           greedy: dict[str, Any]) -> tuple[Callable[..., Any], torch.Tensor, float]:
    """One runner made ready as the table's setup column counts it: compiled or optimized,
    then called twice (every graph captured); returns it, its tokens and the seconds."""
    start = time.perf_counter()
    if label == "compile":
        torch._dynamo.reset()  # each row compiles as a fresh process would
        runner = compile_recipe(model)
    else:
        words = label.split()  # "autoopt", "autoopt int8", "autoopt int8 forced"
        precision = words[1] if len(words) > 1 else None
        # int8/int4 timed whatever their agreement: the table shows it.
        chosen = {"min_agreement": 0.0} if precision in ("bf16", "int8", "int4") else {}
        if words[-1] == "forced":
            chosen["force"] = True
        options = {"precision": chosen} if chosen else None
        runner = autoopt.optimize(model, (ids,), precision=precision,
                                  pass_options=options).generate
    tokens = runner(ids, **greedy)
    # autoopt's first call runs the prompt step eagerly and sizes the cache; the second
    # captures the prompt graph: both are setup.
    runner(ids, **greedy)
    if ids.is_cuda:
        torch.cuda.synchronize(ids.device)
    return runner, tokens, time.perf_counter() - start


def cold_setup(name: str, batch: int, prompt: int, new: int, label: str, threads: int,
               device: torch.device, timeout_s: float = 3600) -> float | str:
    """``set_up`` in a fresh process with empty Inductor and autoopt caches, less a third,
    steady call: the seconds, or why there are none."""
    with tempfile.TemporaryDirectory(prefix="autoopt-cold-") as folder:
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": f"{folder}/inductor",
               "XDG_CACHE_HOME": f"{folder}/xdg"}
        command = [sys.executable, str(Path(__file__).resolve()), "--child-setup", label,
                   "--models", name, "--batches", str(batch), "--prompt", str(prompt),
                   "--new", str(new), "--threads", str(threads), "--device", str(device)]
        result = child_process.run(command, env, timeout_s)
    return result["error"] if "error" in result else float(result["setup_s"])


def _child_setup(args: argparse.Namespace) -> int:
    device = torch.device(args.device)
    torch.manual_seed(0)
    model = MODELS[args.models]().to(device)
    ids = torch.randint(1, model.config.vocab_size, (int(args.batches), args.prompt),
                        device=device)
    greedy = dict(max_new_tokens=args.new, **TIMED)
    runner, _, seconds = set_up(args.child_setup, model, ids, greedy)
    start = time.perf_counter()
    synced(runner, device)(ids, **greedy)
    steady = time.perf_counter() - start
    child_process.report({"setup_s": seconds - steady})
    return 0


# What a weight of each llama.cpp file type costs in bytes (Q8_0: 32 int8 and an f16 scale
# per block of 32; Q4_0: 32 nibbles and an f16 scale).
GGUF_BYTES = {"f32": 4.0, "f16": 2.0, "Q8_0": 34 / 32, "Q4_0": 18 / 32}


def llama_cpp_runners(model: nn.Module, ids: torch.Tensor, new: int, device: torch.device,
                      folder: Path) -> dict[str, Any]:
    """llama.cpp on the same weights at each of ``gguf_file.TYPES``, by label: (generate, its
    tokens, setup seconds: writing the file, loading it and two calls), or why not."""
    labels = [f"llama.cpp {kind}" for kind in gguf_file.TYPES]
    why = ("the CPU only" if device.type != "cpu" else
           "batch 1 only (llama-cpp-python's generate)" if ids.shape[0] != 1 else
           gguf_file.available())
    if why:
        return {"llama.cpp": f"skipped: {why}"}
    found: dict[str, Any] = {}
    for kind, label in zip(gguf_file.TYPES, labels, strict=True):
        print(f"[{model.config.model_type} b1] {label}: write, load and two calls", flush=True)
        start = time.perf_counter()
        path = gguf_file.write(model, folder / f"{model.config.model_type}-{kind}.gguf", kind)
        runner = gguf_file.Runner(path, torch.get_num_threads(), ids.shape[1] + new + 8)
        tokens = runner.generate(ids, new)
        runner.generate(ids, new)
        found[label] = runner.generate, tokens, time.perf_counter() - start
    return found


def run_model(name: str, batch: int, prompt: int, new: int, rounds: int,
              bytes_per_s: float, device: torch.device, cold: bool = False,
              int8_forced: bool = False, llama_cpp: bool = True) -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory(prefix="autoopt-gguf-") as folder:
        return _run_model(name, batch, prompt, new, rounds, bytes_per_s, device, cold,
                          int8_forced, llama_cpp, Path(folder))


def _run_model(name: str, batch: int, prompt: int, new: int, rounds: int,
               bytes_per_s: float, device: torch.device, cold: bool, int8_forced: bool,
               llama_cpp: bool, folder: Path) -> list[dict[str, Any]]:
    torch.manual_seed(0)
    model = MODELS[name]().to(device)
    ids = torch.randint(1, model.config.vocab_size, (batch, prompt), device=device)
    runners: dict[str, Callable[..., Any]] = {"eager": synced(model.generate, device)}
    setup: dict[str, float] = {}
    tokens: dict[str, torch.Tensor] = {}
    modules: dict[str, nn.Module] = {}
    failed: dict[str, str] = {}
    greedy = dict(max_new_tokens=new, **TIMED)
    print(f"[{name} b{batch}] eager reference", flush=True)
    tokens["eager"] = model.generate(ids, **greedy)
    print(f"[{name} b{batch}] torch.compile recipe (compiling)", flush=True)
    try:
        recipe, tokens["compile"], setup["compile"] = set_up("compile", model, ids, greedy)
    except Exception as exc:  # noqa: BLE001 - a peer that fails is a row that says so
        failed["compile"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:80]}"
        print(f"[{name} b{batch}] the recipe failed: {failed['compile']}", flush=True)
    else:
        runners["compile"] = synced(recipe, device)
    low = "int8" if device.type == "cpu" else "bf16"  # int8 and int4 are CPU kernels
    labels = ("autoopt",) + (("autoopt bf16", "autoopt int8", "autoopt int4")
                             if low == "int8" else ("autoopt bf16",)) + (
        (f"autoopt {low} forced",) if int8_forced else ())
    for label in labels:
        print(f"[{name} b{batch}] {label}: optimize and two generate calls", flush=True)
        try:
            generate, tokens[label], setup[label] = set_up(label, model, ids, greedy)
        except autoopt.ConfigError as exc:  # precision= that applies to no linear here
            failed[label] = f"ConfigError: {str(exc).splitlines()[0][:80]}"
            print(f"[{name} b{batch}] {label}: {exc}", flush=True)
            continue
        runners[label] = synced(generate, device)
        modules[label] = generate.__self__
    peers = llama_cpp_runners(model, ids, new, device, folder) if llama_cpp else {}
    for label, peer in peers.items():
        if isinstance(peer, str):
            failed[label] = peer
            continue
        runners[label], tokens[label], setup[label] = peer
    cold_s: dict[str, float | str] = {}
    for label in ("compile", "autoopt", f"autoopt {low}") if cold else ():
        if label in runners:
            print(f"[{name} b{batch}] {label}: cold setup in a fresh process", flush=True)
            cold_s[label] = cold_setup(name, batch, prompt, new, label,
                                       torch.get_num_threads(), device)
    print(f"[{name} b{batch}] timing {rounds} interleaved round(s)", flush=True)
    timings = time_generation(runners, ids, new, rounds)
    load = os.getloadavg()[0]  # over the last minute of the timed rounds
    weights = weight_bytes(model)
    read_fp32 = read_per_step(model)
    eager = timings["eager"].decode_tokens_per_s
    # Only where the weights are stored in low precision: fp32 runners generate eager's tokens.
    print(f"[{name} b{batch}] autoopt {low}: next tokens given eager's prefix", flush=True)
    forced = {label: next_token_agreement(runners[label], model, tokens["eager"], prompt)
              for label in (*labels[1:], *peers) if label in modules or label in runners}
    rows: list[dict[str, Any]] = [dict(model=name, batch=batch, runner=label, failed=why,
                                       weights_mib=weight_bytes(model) / 2**20)
                                  for label, why in failed.items()]
    for label, t in timings.items():
        words = label.split()
        read = read_fp32 / {"int8": 4, "int4": 8, "bf16": 2,
                            **{k: 4 / b for k, b in GGUF_BYTES.items()}}.get(
            words[1] if len(words) > 1 else "", 1)
        rows.append(dict(model=name, batch=batch, runner=label,
                         first_ms=t.first_token_s * 1e3, decode=t.decode_tokens_per_s,
                         speedup=t.decode_tokens_per_s / eager,
                         same=agreement(tokens[label], tokens["eager"], prompt),
                         forced=forced[label][0] if label in forced else None,
                         logit_error=forced[label][1] if label in forced else None,
                         roofline=batch * bytes_per_s / read,
                         of_roofline=t.decode_tokens_per_s / (batch * bytes_per_s / read),
                         setup=setup[label] - t.total_s if label in setup else None,
                         cold=cold_s.get(label), weights_mib=weights / 2**20, load=load))
    return rows


def table(rows: list[dict[str, Any]], threads: int, command: str, bytes_per_s: float,
          prompt: int, new: int, device: torch.device, cold: bool = False) -> str:
    title, machine = heading("LLM decoding", device)
    lines = [
        title, "",
        f"`{command}` — {machine}, {threads} thread(s), torch {torch.__version__}, "
        f"transformers {transformers.__version__}, Python {platform.python_version()}. "
        f"Prompt {prompt} tokens, {new} new, greedy; medians of interleaved rounds. Memory "
        f"bandwidth measured here: {bytes_per_s / 1e9:.1f} GB/s. Roofline = batch × "
        f"bandwidth / bytes of weights a step reads (all but embedding tables that are not "
        f"the output head; int8 rows: a byte per weight, int4 half, bf16 two; the KV cache and "
        f"activations not counted). New tokens = eager's: the fraction of generated tokens "
        f"equal to eager's at the same position; next token = eager's: the fraction of "
        f"eager's new tokens the runner also ranks first given eager's prefix (its own generate "
        f"with eager's tokens forced at each step by a logits processor; low-precision rows, "
        f"with the largest logit error there; "
        f"bf16, int8 and int4 rows pass min_agreement=0, so that a precision the agreement would "
        f"refuse is timed). Setup = the time until every graph "
        f"is ready: optimize or compile plus two calls, less one call's median time (autoopt's "
        f"first call runs the prompt step eagerly to size the cache, its second captures the "
        f"prompt graph; the recipe compiles in its first; llama.cpp: writing the GGUF file, "
        f"loading it and two calls). llama.cpp rows: llama-cpp-python built from source here, "
        f"on GGUF files of the same weights (bench/gguf_file.py: every matrix in the named "
        f"type, as `llama-quantize --pure`; the roofline counts Q8_0 as 34 bytes per 32 "
        f"weights, Q4_0 as 18)" + (
            "; cold setup = the same in a fresh process with empty Inductor and autoopt "
            "caches, less a third call there (a new user's first run)." if cold else ".")
        + " Load = the 1-minute load average when the model's timed rounds ended (about the "
        "thread count: the bench alone; more: other jobs shared the cores).",
        "",
        "| model | batch | runner | first token ms | decode tokens/s | vs eager | roofline "
        "tokens/s | of roofline | new tokens = eager's | next token = eager's | largest logit "
        "error | setup s |" + (" cold setup s |" if cold else "") + " load |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|" + ("---|" if cold else "") + "---|"]
    for r in rows:
        if "failed" in r:
            lines.append(f"| {r['model']} ({r['weights_mib']:.0f} MiB) | {r['batch']} | "
                         f"{r['runner']} | "
                         f"{'' if r['failed'].startswith('skipped') else 'failed: '}"
                         f"{r['failed']} | | | | | | | | | |"
                         + (" |" if cold else ""))
            continue
        setup = f"{r['setup']:.1f}" if r["setup"] is not None else "-"
        forced = f"{r['forced']:.1%}" if r["forced"] is not None else "-"
        logit_error = f"{r['logit_error']:.3g}" if r["logit_error"] is not None else "-"
        found = r.get("cold")
        first = (f" {found:.1f} |" if isinstance(found, float) else
                 f" {found or '-'} |") if cold else ""
        lines.append(f"| {r['model']} ({r['weights_mib']:.0f} MiB) | {r['batch']} | "
                     f"{r['runner']} | {r['first_ms']:.1f} | {r['decode']:.1f} | "
                     f"{r['speedup']:.2f}× | {r['roofline']:.0f} | {r['of_roofline']:.0%} | "
                     f"{r['same']:.1%} | {forced} | {logit_error} | {setup} |{first} "
                     f"{r['load']:.2f} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--new", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:N] (int8 rows become "
                        "bf16 rows on a GPU)")
    parser.add_argument("--write", action="store_true", help="update docs/benchmarks.md")
    parser.add_argument("--out", type=Path, help="also write the table to this file")
    parser.add_argument("--cold", action="store_true",
                        help="also time each runner's setup in a fresh process with empty "
                             "Inductor and autoopt caches")
    parser.add_argument("--int8-forced", action="store_true",
                        help="also autoopt int8 with pass_options={'precision': {'force': "
                             "True}}: int8 wherever its error fits, its speed not measured")
    parser.add_argument("--no-llama-cpp", action="store_true",
                        help="leave out llama.cpp's rows (f32, f16, Q8_0, Q4_0 files of the "
                             "same weights, batch 1; where llama-cpp-python is installed)")
    parser.add_argument("--child-setup", metavar="RUNNER", help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.child_setup:
        return _child_setup(args)
    device = torch.device(args.device)
    bytes_per_s = bandwidth(device)
    rows = []
    for name in args.models.split(","):
        for batch in map(int, args.batches.split(",")):
            rows.extend(run_model(name, batch, args.prompt, args.new, args.rounds,
                                  bytes_per_s, device, args.cold, args.int8_forced,
                                  not args.no_llama_cpp))
    command = "python bench/generate.py " + " ".join(sys.argv[1:])
    publish(table(rows, args.threads, command.strip(), bytes_per_s, args.prompt, args.new,
                  device, args.cold), write=args.write, out=args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
