"""The real-model corpus: every eval-mode model is optimized for inference and compared with
eager on fresh inputs; every train-mode model is optimized with ``training=True`` and its
outputs, a loss (its first floating output weighed by fixed random numbers), parameter
gradients and buffers compared with an eager copy's. Zero wrong results, zero uncaught
exceptions, at least 95% of the models captured as one whole graph (export or symbolic_trace);
the summary (capture method, whole graph or why not, rewrites, result) is written to a file, not
the test output.

    pytest tests/test_corpus.py -q          # table in $TMPDIR/autoopt-corpus.md (docs/corpus.md)
"""

from __future__ import annotations

import copy
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from checks import assert_bit_identical, snapshot
from corpus_models import TRAINING, corpus

import autoopt
from autoopt.check.compare import GRAD_PREFIX, compare
from autoopt.check.inputs import input_sets

TABLE = Path(tempfile.gettempdir()) / "autoopt-corpus.md"  # the summary, one file per run

MODELS = corpus()
WHOLE_GRAPH = ("export", "symbolic_trace")  # capture methods that give one graph for the model
MIN_WHOLE_GRAPH_SHARE = 0.95


@dataclass
class Outcome:
    """One row of the summary."""

    model: str
    result: str  # "optimized", "fell back" or "failed"
    mode: str = "eval"  # "eval": optimized for inference; "train": training=True, gradients
    capture: str = ""
    passes: dict[str, int] = field(default_factory=dict)
    rolled_back: list[str] = field(default_factory=list)
    detail: str = ""
    seconds: float = 0.0
    speedup: float | None = None  # eager / optimized latency, 1 thread, interleaved medians
    why_not_whole: str = ""  # why export and symbolic_trace did not capture it

    @property
    def whole_graph(self) -> bool:
        return self.capture in WHOLE_GRAPH


_OUTCOMES: dict[str, Outcome] = {}


def _why_not_whole(attempts: list[tuple[str, str]]) -> str:
    return "; ".join(f"{m}: {r.splitlines()[0] if r else ''}"[:160] for m, r in attempts
                     if m in WHOLE_GRAPH)


def _run_one(name: str) -> Outcome:
    torch.manual_seed(0)
    model, args, kwargs = MODELS[name]()
    if model.training:
        return _run_training(name, model, args, kwargs)
    before = snapshot(model)
    reference = copy.deepcopy(model)
    start = time.perf_counter()
    fast = autoopt.optimize(model, args, kwargs, training=False)
    report = fast.report
    if report.deferred:  # a model that generates builds its forward on the first call
        with torch.no_grad():
            fast(*args, **kwargs)
    seconds = time.perf_counter() - start
    capture = report.captures[0]
    with torch.no_grad():
        for i, (a, k) in enumerate(input_sets(args, kwargs, 1, seed=123)):
            result = compare(reference(*a, **k), fast(*a, **k))
            if not result.ok:
                return Outcome(name, "failed", capture=capture.method,
                               detail=f"wrong output on input set {i}: {result.detail}",
                               seconds=seconds)
    assert_bit_identical(model, before)
    why_not = _why_not_whole(capture.attempts)
    if capture.method == "eager":
        why = "; ".join(f"{m}: {r}" for m, r in capture.attempts)
        return Outcome(name, "fell back", capture="eager", detail=why[:200], seconds=seconds,
                       why_not_whole=why_not)
    return Outcome(name, "optimized", capture=capture.method, passes=report.pass_counts,
                   rolled_back=report.rolled_back, seconds=seconds,
                   speedup=_speedup(reference, fast, args, kwargs), why_not_whole=why_not)


def _first_float(value: Any) -> torch.Tensor | None:
    """The first floating tensor in an output (logits, last hidden state), depth first."""
    if isinstance(value, torch.Tensor):
        return value if value.is_floating_point() else None
    items = value.values() if isinstance(value, dict) else value
    if isinstance(items, (list, tuple)) or isinstance(value, dict):
        for item in items:
            found = _first_float(item)
            if found is not None:
                return found
    return None


def _train_step(module: torch.nn.Module, forward: Any, args: tuple, kwargs: dict, step: int
                ) -> dict[str, Any]:
    """One forward and backward through ``forward``: the output, the loss, ``module``'s
    parameter gradients (named as verify names gradients) and buffers (BatchNorm's running
    statistics).

    The loss weighs the first floating output by fixed random numbers. A plain sum of squares
    would not do: the last hidden state of BERT, DistilBERT or ViT leaves a LayerNorm whose
    weight is 1 and bias 0 at initialization, so its sum of squares is the element count
    whatever the input, and every gradient before that LayerNorm would be rounding noise."""
    module.zero_grad(set_to_none=True)
    output = forward(*args, **kwargs)
    first = _first_float(output)
    weights = torch.randn(first.shape, generator=torch.Generator().manual_seed(step))
    loss = (first * weights).sum()
    loss.backward()
    grads = {n: p.grad for n, p in module.named_parameters() if p.grad is not None}
    buffers = {n: b.detach().clone() for n, b in module.named_buffers()}
    return {"output": output, "loss": loss.detach(), "grads": grads, "buffers": buffers}


def _compare_step(expected: dict[str, Any], actual: dict[str, Any]) -> str | None:
    """Why two training steps differ, or None. Each parameter's gradient is compared on its
    own (with verify's gradient tolerance at its own scale), so that a small gradient is not
    held only at the scale of the largest one."""
    if not expected["grads"]:
        return "no parameter has a gradient in eager: nothing to compare"
    if expected["grads"].keys() != actual["grads"].keys():
        return ("gradients reach different parameters: "
                f"{sorted(expected['grads'].keys() ^ actual['grads'].keys())[:3]}")
    rest = compare({k: v for k, v in expected.items() if k != "grads"},
                   {k: v for k, v in actual.items() if k != "grads"})
    if not rest.ok:
        return rest.detail
    for name, grad in expected["grads"].items():
        result = compare({f"{GRAD_PREFIX}{name}": grad},
                         {f"{GRAD_PREFIX}{name}": actual["grads"][name]})
        if not result.ok:
            return result.detail
    return None


def _run_training(name: str, model: torch.nn.Module, args: tuple, kwargs: dict) -> Outcome:
    """A train-mode model: optimized with ``training=True``; outputs, loss, gradients and
    buffers compared with an eager deep copy, call after call on fresh inputs. The optimized
    module trains its own copy of the weights (``fast.module``)."""
    before = snapshot(model)
    reference = copy.deepcopy(model)
    start = time.perf_counter()
    fast = autoopt.optimize(model, args, kwargs, training=True)
    seconds = time.perf_counter() - start
    report = fast.report
    capture = report.captures[0]
    for i, (a, k) in enumerate(input_sets(args, kwargs, 2, seed=123)):
        expected = _train_step(reference, reference, a, k, step=i)
        actual = _train_step(fast.module, fast, a, k, step=i)
        failure = _compare_step(expected, actual)
        if failure:
            return Outcome(name, "failed", "train", capture.method, seconds=seconds,
                           detail=f"wrong result on input set {i}: {failure}")
    assert_bit_identical(model, before)
    why_not = _why_not_whole(capture.attempts)
    if capture.method == "eager":
        why = "; ".join(f"{m}: {r}" for m, r in capture.attempts)
        return Outcome(name, "fell back", "train", "eager", detail=why[:200], seconds=seconds,
                       why_not_whole=why_not)
    return Outcome(name, "optimized", "train", capture.method, report.pass_counts,
                   report.rolled_back, seconds=seconds, why_not_whole=why_not)


def _speedup(eager: torch.nn.Module, fast: torch.nn.Module, args: tuple, kwargs: dict,
             rounds: int = 5) -> float:
    """Eager latency over optimized latency on the example inputs: medians of interleaved
    rounds on one thread (a figure for the summary, not a pass/fail criterion)."""
    times: dict[str, list[float]] = {"eager": [], "fast": []}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.no_grad():
            eager(*args, **kwargs), fast(*args, **kwargs)  # warm-up
            for _ in range(rounds):
                for key, fn in (("eager", eager), ("fast", fast)):
                    start = time.perf_counter()
                    fn(*args, **kwargs)
                    times[key].append(time.perf_counter() - start)
    finally:
        torch.set_num_threads(threads)
    return statistics.median(times["eager"]) / statistics.median(times["fast"])


@pytest.mark.slow
@pytest.mark.parametrize("name", list(MODELS))
def test_corpus_model_matches_eager(name: str) -> None:
    try:
        outcome = _run_one(name)
    except Exception as exc:
        mode = "train" if name in TRAINING else "eval"
        _OUTCOMES[name] = Outcome(name, "failed", mode,
                                  detail=f"{type(exc).__name__}: {exc}"[:200])
        raise
    _OUTCOMES[name] = outcome
    assert outcome.result != "failed", outcome.detail


def _table(outcomes: list[Outcome]) -> str:
    lines = ["| model | mode | capture | whole graph | passes fired | result | optimize s "
             "| speedup |",
             "|---|---|---|---|---|---|---|---|"]
    for o in outcomes:
        passes = ", ".join(f"{k}={v}" for k, v in sorted(o.passes.items())) or "-"
        if o.rolled_back:
            passes += f" (rolled back: {', '.join(o.rolled_back)})"
        result = o.result + (f": {o.detail}" if o.detail else "")
        speedup = f"{o.speedup:.2f}×" if o.speedup is not None else "-"
        whole = "yes" if o.whole_graph else "no"
        lines.append(f"| {o.model} | {o.mode} | {o.capture or '-'} | {whole} | {passes} | "
                     f"{result} | {o.seconds:.1f} | {speedup} |")
    return "\n".join(lines)


@pytest.mark.slow
def test_corpus_summary() -> None:
    """Runs after the models (same module, later in file order): write the table, check the
    totals. Models run in an earlier session or deselected are simply absent."""
    if not _OUTCOMES:
        pytest.skip("no corpus model ran in this session")
    outcomes = [_OUTCOMES[n] for n in MODELS if n in _OUTCOMES]
    counts = {r: sum(o.result == r for o in outcomes) for r in ("optimized", "fell back",
                                                                 "failed")}
    speedups = [o.speedup for o in outcomes if o.speedup]
    geomean = statistics.geometric_mean(speedups) if speedups else float("nan")
    ran = [o for o in outcomes if o.capture]  # a model that raised has no capture to count
    whole = sum(o.whole_graph for o in ran)
    share = whole / len(ran) if ran else 1.0
    not_whole = [o for o in ran if not o.whole_graph]
    why = "".join(f"- {o.model} ({o.mode}, {o.capture}): {o.why_not_whole}\n"
                  for o in not_whole) or "- none\n"
    modes = {m: sum(o.mode == m for o in outcomes) for m in ("eval", "train")}
    TABLE.write_text(f"autoopt corpus: {len(outcomes)} models ({modes['eval']} eval, "
                     f"{modes['train']} train), {counts['optimized']} optimized, "
                     f"{counts['fell back']} fell back, {counts['failed']} failed; "
                     f"{whole} of {len(ran)} captured as one whole graph ({share:.1%}); "
                     f"geometric-mean inference speedup over eager {geomean:.2f}× (1 thread, "
                     f"example inputs)\n\nNot whole graph:\n{why}\n"
                     f"{_table(outcomes)}\n")
    assert counts["failed"] == 0, [o.model for o in outcomes if o.result == "failed"]
    assert share >= MIN_WHOLE_GRAPH_SHARE, (
        f"{whole} of {len(ran)} whole-graph ({share:.1%}); not: "
        + "; ".join(f"{o.model}: {o.why_not_whole}" for o in not_whole))
