"""The real-model corpus: every model is optimized for inference and compared with eager on
fresh inputs. Zero wrong outputs, zero uncaught exceptions; the summary (optimized with capture
method and rewrites / fell back with reason / failed) is written to a file, not the test output.

    pytest tests/test_corpus.py -q          # table in $TMPDIR/autoopt-corpus.md (docs/corpus.md)
"""

from __future__ import annotations

import copy
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from checks import assert_bit_identical, snapshot
from corpus_models import corpus

import autoopt
from autoopt.verify import compare, input_sets

TABLE = Path(tempfile.gettempdir()) / "autoopt-corpus.md"  # the summary, one file per run

MODELS = corpus()


@dataclass
class Outcome:
    """One row of the summary."""

    model: str
    result: str  # "optimized", "fell back" or "failed"
    capture: str = ""
    passes: dict[str, int] = field(default_factory=dict)
    rolled_back: list[str] = field(default_factory=list)
    detail: str = ""
    seconds: float = 0.0
    speedup: float | None = None  # eager / optimized latency, 1 thread, interleaved medians


_OUTCOMES: dict[str, Outcome] = {}


def _run_one(name: str) -> Outcome:
    torch.manual_seed(0)
    model, args, kwargs = MODELS[name]()
    before = snapshot(model)
    reference = copy.deepcopy(model)
    start = time.perf_counter()
    fast = autoopt.optimize(model, args, kwargs, training=False)
    seconds = time.perf_counter() - start
    report = fast.report
    capture = report.captures[0]
    with torch.no_grad():
        for i, (a, k) in enumerate(input_sets(args, kwargs, 1, seed=123)):
            result = compare(reference(*a, **k), fast(*a, **k))
            if not result.ok:
                return Outcome(name, "failed", capture.method,
                               detail=f"wrong output on input set {i}: {result.detail}",
                               seconds=seconds)
    assert_bit_identical(model, before)
    if capture.method == "eager":
        why = "; ".join(f"{m}: {r}" for m, r in capture.attempts)
        return Outcome(name, "fell back", "eager", detail=why[:200], seconds=seconds)
    detail = "; ".join(f"not {m}: {r[:60]}" for m, r in capture.attempts)
    return Outcome(name, "optimized", capture.method, report.pass_counts, report.rolled_back,
                   detail, seconds, _speedup(reference, fast, args, kwargs))


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
        _OUTCOMES[name] = Outcome(name, "failed", detail=f"{type(exc).__name__}: {exc}"[:200])
        raise
    _OUTCOMES[name] = outcome
    assert outcome.result != "failed", outcome.detail


def _table(outcomes: list[Outcome]) -> str:
    lines = ["| model | capture | passes fired | result | optimize s | speedup |",
             "|---|---|---|---|---|---|"]
    for o in outcomes:
        passes = ", ".join(f"{k}={v}" for k, v in sorted(o.passes.items())) or "-"
        if o.rolled_back:
            passes += f" (rolled back: {', '.join(o.rolled_back)})"
        result = o.result + (f": {o.detail}" if o.detail else "")
        speedup = f"{o.speedup:.2f}×" if o.speedup is not None else "-"
        lines.append(f"| {o.model} | {o.capture or '-'} | {passes} | {result} | "
                     f"{o.seconds:.1f} | {speedup} |")
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
    TABLE.write_text(f"autoopt corpus: {len(outcomes)} models, {counts['optimized']} optimized, "
                     f"{counts['fell back']} fell back, {counts['failed']} failed; geometric-mean "
                     f"speedup over eager {geomean:.2f}× (1 thread, example inputs)\n\n"
                     f"{_table(outcomes)}\n")
    assert counts["failed"] == 0, [o.model for o in outcomes if o.result == "failed"]
