"""Choosing a graph's backend: every candidate lowered, verified, then measured.

A candidate that cannot be built (not installed, an op it lacks, a compile error, more memory
than ``optimize_memory`` or the free memory leaves) or whose results differ from eager is
skipped with its reason; the verified ones are timed by the cost model on the real inputs and
the fastest runs the calls. The measurement is cached on disk under the graph's identity (its
code, weights' shapes, inputs' shapes, the candidates, the device, thread count and library
versions), so the next ``optimize`` of the same model builds and verifies only the winner.

Candidates are built one at a time, so that no two compilers' copies of the weights are alive
together. Where eager's own call is given as the yardstick (a whole graph), each candidate is
timed against it, interleaved, and candidates are compared by their time over eager's; the
fastest so far may then drop what it can make again (the aten lowering's packed weights:
0.8× a decoder's weights) before a candidate with copies of its own (Inductor's, ONNX
Runtime's) is built, and packs it again if it stays fastest. Otherwise (a Dynamo subgraph) each
candidate is timed against the fastest so far, and the slower one is freed before the next is
built.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from autoopt.backends.base import Lowering
from autoopt.check.compare import VerifyResult
from autoopt.check.report import BackendChoice
from autoopt.check.state import preserved
from autoopt.cost_model import CostModel
from autoopt.errors import ConfigError, first_line
from autoopt.observe import memory_profile

log = logging.getLogger(__name__)

# Rounds of interleaved timing per choice, and the seconds after which to stop (at least 3).
_ROUNDS, _BUDGET_S = 9, 3.0
# How much faster a candidate must measure to replace one earlier in the order of preference.
# Closer than this, the medians of one run's interleaved rounds swap places from run to run
# (the inference bench: 1-3% between runs), so the difference is not a measured win, and the
# earlier candidate is the cheaper one to have: built again from the caches, aten costs
# nothing and Inductor with freezing 10-20 s (its weight packing runs before its cache is
# read), and it holds no compiler's copy of the weights.
MARGIN = 0.02
# How a candidate that built and computed another function than eager's is reported.
DIFFERS = "differs from eager"
# How a candidate left out by the prediction from similar graphs is reported (prediction.py).
PREDICTED = "predicted out"
# How a candidate left out because it cannot win is reported (``Lowering.at_best``).
NOT_BUILT = "not built: "
# How a candidate that failed to build is reported; and one that failed when the record was
# made and again when the choice was measured anew for it: not transient, so not tried again
# for this record.
FAILED = "failed to lower: "
FAILED_AGAIN = "failed to lower again: "


def failed_to_build(why: str) -> bool:
    return why.startswith((FAILED, FAILED_AGAIN))


def replaces(seconds: float, best: float) -> bool:
    """Whether a candidate measured at ``seconds`` replaces the best so far (``best``), which
    comes earlier in the order of preference: only when faster by more than ``MARGIN``."""
    return seconds < best * (1.0 - MARGIN)


def decided(order: Sequence[str], seconds: dict[str, float]) -> str | None:
    """The candidate ``choose_backend`` keeps among ``seconds``, taken in ``order``: the
    measured choice made again from its record."""
    best: str | None = None
    for name in (n for n in order if n in seconds):
        if best is None or replaces(seconds[name], seconds[best]):
            best = name
    return best


def choose_backend(graph: str, lowerings: Sequence[Lowering], skipped: dict[str, str], *,
                   verify: Callable[[Callable[..., Any]], VerifyResult] | None,
                   timer: Callable[[Callable[..., Any]], Callable[[], Any]],
                   cost_model: CostModel, what: str, required: bool, gradients: bool,
                   state: Sequence[Any] = (), reference: Callable[..., Any] | None = None,
                   floor_s: Callable[[], float | None] | None = None,
                   predictor: Any = None,
                   ) -> tuple[Callable[..., Any], BackendChoice]:
    """The callable to run ``graph`` with, and the record of the choice.

    Args:
        graph: which graph, for the report (``whole graph``, ``subgraph 2``).
        lowerings: the candidates that apply, in order of preference on a tie.
        skipped: candidates that do not apply here, with why (they join the record).
        verify: compares a built candidate with eager; None trusts it.
        timer: a no-argument callable that runs one built candidate once on real inputs
            (with its backward for a graph with gradients); where runs write their inputs, it
            has a ``reset()`` that puts them back, called untimed before each run.
        cost_model: what measures, and caches what it measured.
        what: the graph's identity, for the cache key.
        required: the user named this one backend: a failure raises instead of falling back.
        gradients: the timed runs need gradients enabled.
        state: what the timed runs may write, restored after them.
        reference: eager's callable, the yardstick every candidate is timed against (see the
            module's docstring); None: candidates are timed against each other.
        floor_s: gives the least seconds a call can take at this machine's measured peak
            (asked only where candidates are timed); a time below it is measured again (see
            ``CostModel.fastest``).
        predictor: a ``prediction.Predictor``: predicts the choice from those measured on
            similar graphs here, so that
            the candidates it leaves out are not built (``prediction.py``); it remembers a
            full measurement made here. Used where candidates are timed against eager and
            the user did not require one backend.
    """
    skipped = dict(skipped)
    requested = [lowering.name for lowering in lowerings] + list(skipped)
    dominance = [f"{lw.name}<{lw.dominated_by[0]}" for lw in lowerings if lw.dominated_by]
    if dominance:  # a choice made skipping those is not one made measuring every candidate
        what = f"{what}|dominated={','.join(dominance)}"
    # The cache holds a choice among the candidates that could be built: one skipped up front
    # then (not installed, not applicable to such a graph) and a candidate now is measured,
    # not hidden by a record made without it.
    candidates = [lowering.name for lowering in lowerings]
    if required and skipped and not lowerings:
        name, why = next(iter(skipped.items()))
        raise ConfigError(f"backend={name!r} cannot execute the {graph}: {why}. Pass "
                          f"backends=({name!r}, 'aten') to fall back when it cannot.")

    built: set[str] = set()  # built and verified here, for ``dominated_by``

    def dominated(lowering: Lowering) -> bool:
        if lowering.dominated_by is None or lowering.dominated_by[0] not in built:
            return False
        skipped[lowering.name] = lowering.dominated_by[1]
        return True

    def build(lowering: Lowering) -> Callable[..., Any] | None:
        if dominated(lowering):
            return None
        short = memory_profile.allowance().shortfall(  # the choice's record says why
            lowering.memory, f"the {lowering.name} backend", note=False)
        if short:
            skipped[lowering.name] = f"not built for memory: it {short}"
            return None
        log.info("backend: lowering the %s with %s", graph, lowering.name)
        start = time.perf_counter()
        try:
            # Building may run the graph (a warm-up, a lowering's own look at it): what a run
            # writes (BatchNorm statistics in train mode) is put back, as after verifying.
            with memory_profile.stage(f"backend {lowering.name}"), preserved(*state):
                with memory_profile.stage("build"):
                    run = lowering.build()
                with memory_profile.stage("verify"):
                    verdict = None if lowering.verified or verify is None else verify(run)
        except Exception as exc:  # noqa: BLE001 - a backend that fails is skipped, not fatal
            log.info("backend %s failed: %s", lowering.name, exc)
            again = failed_to_build(failed.get(lowering.name, ""))
            skipped[lowering.name] = (f"{FAILED_AGAIN if again else FAILED}"
                                      f"{_failure(exc)}")
            return None
        if verdict is not None and not verdict.ok:
            skipped[lowering.name] = f"{DIFFERS} ({verdict.detail})"
            return None
        log.info("backend: %s ready in %.1f s", lowering.name, time.perf_counter() - start)
        built.add(lowering.name)
        return run

    stored = cost_model.recorded(what, candidates)
    failed = cost_model.recorded_failures(what, candidates) if stored else {}
    # A candidate that failed to build or to be timed when the record was made: such a
    # failure may be transient (memory, a compiler's temporary error), so the choice is
    # measured again rather than made for good without it; once (a graph with an op ONNX
    # has no translation for fails each time, and each optimize measured every candidate
    # again for it). One that built and computed another function is not tried again (its
    # reason is reported): that does not pass.
    retried = [name for name in _unmeasured(lowerings, stored or {})
               if not failed.get(name, "").startswith((DIFFERS, PREDICTED, NOT_BUILT,
                                                       FAILED_AGAIN))]
    if stored and retried:
        log.info("backend: measuring the %s again: %s", graph, "; ".join(
            f"{name} was not measured ({failed.get(name, 'failed')})" for name in retried))
        stored = None
    for name, why in failed.items():
        if stored and name in candidates:
            skipped.setdefault(name, f"{why}, when this choice was measured")
    if stored:
        eager = cost_model.recorded(f"{what}|eager", [_EAGER]) or {}
        first = decided(candidates, stored)
        for lowering in sorted((lw for lw in lowerings if lw.name in stored),
                               key=lambda lw: (lw.name != first, stored[lw.name])):
            run = build(lowering)
            if run is not None:
                return run, BackendChoice(graph, lowering.name, stored, skipped, cached=True,
                                          regions=_regions(lowering),
                                          eager_s=eager.get(_EAGER))

    eager_s = None
    measuring = _Measuring(cost_model, state, gradients, floor_s)
    if reference is not None:
        prediction = predictor.predict(candidates, {
            lw.name: lw.dominated_by[0] for lw in lowerings if lw.dominated_by}) \
            if predictor and not required else None
        if prediction is not None:
            log.info("backend: predicted from similar graphs: %s; not built: %s",
                     prediction.winner, ", ".join(prediction.out))
        bounds: dict[str, float] = {}
        best, seconds, eager_s = _against_eager(lowerings, build, dominated, reference, timer,
                                                measuring, what, candidates, skipped,
                                                prediction, bounds)
        full = not any(why.startswith(PREDICTED) for why in skipped.values())
        if predictor is not None and full and eager_s and not measuring.shared:
            predictor.remember(seconds, eager_s, bounds)
    else:
        best, seconds = _against_best(lowerings, build, timer, measuring, what, candidates,
                                      skipped)
    if best is None:
        reasons = "; ".join(f"{name}: {why}" for name, why in skipped.items())
        hint = (f"Pass backends=({requested[0]!r}, 'aten') to fall back when it cannot."
                if required else "Include 'aten' in backends= to always have a way to run it.")
        raise NoBackend(f"no backend of {tuple(requested)} can execute the {graph} "
                        f"({reasons}). {hint}", skipped)
    chosen = next(lowering for lowering in lowerings if lowering.name == best[0])
    if chosen.restore is not None:  # its packed weights, if dropped while another was built
        with memory_profile.stage(f"backend {chosen.name} restore"):
            chosen.restore()
    return best[1], BackendChoice(graph, best[0], seconds, skipped, regions=_regions(chosen),
                                  eager_s=eager_s, shared=measuring.shared)


class NoBackend(ConfigError):
    """No candidate could run the graph; ``skipped`` holds each one's reason."""

    def __init__(self, message: str, skipped: dict[str, str]) -> None:
        super().__init__(message)
        self.skipped = skipped


_EAGER = "eager"
_Build = Callable[[Lowering], "Callable[..., Any] | None"]


class _Measuring:
    """Times candidates through the cost model (interleaved rounds, medians) and keeps why any
    of its measurements may not be this machine's own: the choice's record and report say so,
    and the next ``optimize`` measures it again."""

    def __init__(self, cost_model: CostModel, state: Sequence[Any], gradients: bool,
                 floor_s: Callable[[], float | None] | None) -> None:
        self.cost_model, self.state, self.gradients = cost_model, state, gradients
        self._floor = floor_s
        self.shared = ""

    @functools.cached_property
    def floor_s(self) -> float | None:
        return self._floor() if self._floor is not None else None

    def timings(self, what: str, timed: dict[str, Callable[[], Any]],
                cache_as: Sequence[str] | None = None) -> dict[str, float]:
        """Each timed candidate's median seconds."""
        seconds = self.cost_model.fastest(
            what, timed, repeats=_ROUNDS, state=self.state, grad=self.gradients,
            budget_s=_BUDGET_S, cache_as=cache_as, floor_s=self.floor_s,
            setup={n: fn.reset for n, fn in timed.items() if hasattr(fn, "reset")})[1]
        self.shared = self.shared or self.cost_model.last_sharing
        return seconds

    def record(self, what: str, requested: Sequence[str], seconds: dict[str, float],
               failed: dict[str, str]) -> None:
        self.cost_model.record(what, requested, seconds, failed, shared=self.shared)


def _against_eager(lowerings: Sequence[Lowering], build: _Build,
                   dominated: Callable[[Lowering], bool], reference: Callable[..., Any],
                   timer: Callable[[Callable[..., Any]], Callable[[], Any]],
                   measuring: _Measuring, what: str, requested: Sequence[str],
                   skipped: dict[str, str], prediction: Any = None,
                   bounds: dict[str, float] | None = None,
                   ) -> tuple[tuple[str, Callable[..., Any]] | None, dict[str, float],
                              float | None]:
    """The fastest candidate by its time over eager's, each timed against eager alone, each
    one's seconds (on the scale of eager's first measured time), and that time. Candidates
    the ``prediction`` (a ``prediction.Prediction``) leaves out are built only where the
    time of the fastest built doubts it. ``bounds`` receives the bound over eager of each
    candidate its bound ruled out."""
    bounds = {} if bounds is None else bounds
    best: tuple[Lowering, Callable[..., Any]] | None = None
    ratios: dict[str, float] = {}
    eager_s: list[float] = []
    yardstick = timer(reference)

    def measure(name: str, run: Callable[..., Any]) -> None:
        if run is reference:  # the model as is (no pass changed it): eager, by definition
            ratios[name] = 1.0
            return
        log.info("backend: measuring %s against eager", name)
        try:
            pair = measuring.timings(f"{what}|against eager",
                                     {name: timer(run), _EAGER: yardstick})
        except Exception as exc:  # noqa: BLE001 - a verified candidate that fails when timed
            # It matched eager: it still runs if no other is measured.
            skipped[name] = f"not measured: timing it raised {_failure(exc)}"
            ratios[name] = float("inf")
            return
        ratios[name] = pair[name] / pair[_EAGER]
        eager_s.append(pair[_EAGER])

    def consider(lowering: Lowering) -> None:
        nonlocal best
        if dominated(lowering):  # before its predecessor drops its packed weights for it
            return
        if best is not None:
            # Measured only once a second candidate comes: a lone candidate is not timed.
            if best[0].name not in ratios:
                measure(best[0].name, best[1])
            if lowering.memory and best[0].release is not None:
                dropped = best[0].release()
                if dropped:
                    log.info("backend: %s's packed weights (%.0f MiB) dropped while %s is "
                             "built", best[0].name, dropped / 2**20, lowering.name)
                    memory_profile.release_free_memory()
        run = build(lowering)
        if run is None:
            return
        if best is None:
            best = (lowering, run)
            return
        measure(lowering.name, run)
        if replaces(ratios[lowering.name], ratios[best[0].name]):
            best = (lowering, run)
        # The slower of the two: its weights go before the next is built.
        del run
        memory_profile.release_free_memory()

    out = dict(prediction.out) if prediction is not None else {}
    # A bound reads another candidate's time (hybrid's reads aten's): that one is built where
    # the bounded one is not left out. Building aten costs nothing; hybrid's Inductor compile
    # (10-15 s cold) is what the bound may spare.
    reads = {getattr(lw.at_best, "reads", None) for lw in lowerings
             if lw.at_best is not None and lw.name not in out}
    out = {name: why for name, why in out.items() if name not in reads}
    # Candidates with a bound (``Lowering.at_best``), and those that can at most tie one, come
    # after the others, and are built only where the bound beats the fastest of those.
    bounded = {lw.name for lw in lowerings if lw.at_best is not None}
    bounded |= {lw.name for lw in lowerings if lw.dominated_by and lw.dominated_by[0] in bounded}
    ruled_out: set[str] = set()

    def can_win(lowering: Lowering) -> bool:
        """Whether a bounded candidate may beat the fastest so far; if not, skipped says why."""
        tied = lowering.dominated_by[0] if lowering.dominated_by else None
        if tied in ruled_out:
            skipped[lowering.name] = f"{NOT_BUILT}it can at most tie {tied}, which cannot win"
            ruled_out.add(lowering.name)
            return False
        if lowering.at_best is None or best is None:
            return True
        if best[0].name not in ratios:
            measure(best[0].name, best[1])
        bound, fastest = lowering.at_best(ratios), ratios.get(best[0].name, float("inf"))
        if bound is None or fastest == float("inf") or bound[0] < fastest:
            return True
        bounds[lowering.name] = bound[0]
        skipped[lowering.name] = (f"{NOT_BUILT}at best {bound[0]:.2f}x eager's time "
                                  f"({bound[1]}), not faster than {best[0].name}'s "
                                  f"{fastest:.2f}x")
        ruled_out.add(lowering.name)
        return False

    for lowering in lowerings:
        if lowering.name not in out and lowering.name not in bounded:
            consider(lowering)
    for lowering in lowerings:
        if lowering.name in bounded and lowering.name not in out and can_win(lowering):
            consider(lowering)
    if prediction is not None:
        if best is not None and best[0].name not in ratios:  # the cheap check's one timing
            measure(best[0].name, best[1])
        kept = ratios.get(best[0].name) if best is not None else None
        doubt = prediction.doubt(best[0].name if best is not None else None,
                                 kept if kept != float("inf") else None)
        for lowering in (lw for lw in lowerings if lw.name in out):
            if doubt:
                log.info("backend: building %s, left out by the prediction: %s",
                         lowering.name, doubt)
                if lowering.name not in bounded or can_win(lowering):
                    consider(lowering)
            else:
                skipped[lowering.name] = out[lowering.name]
    # Where the others failed to build, the one left is timed (it mostly was, before the
    # second was built) and recorded: the record spares the next optimize those builds (the
    # int8 prompt step's hybrid and Inductor: 1.5 s at each optimize).
    others_failed = best is not None and any(map(failed_to_build, skipped.values()))
    if others_failed and best[0].name not in ratios:
        measure(best[0].name, best[1])
    if others_failed and not eager_s and ratios.get(best[0].name) == 1.0:
        # The survivor is the model as is (no pass changed it): eager is timed alone.
        eager_s.extend(measuring.timings(f"{what}|eager", {_EAGER: yardstick}).values())
    seconds = {name: ratio * eager_s[0] for name, ratio in ratios.items()
               if eager_s and ratio != float("inf")}
    if len(seconds) > 1 or (seconds and (others_failed or any(n in skipped for n in out))):
        measuring.record(f"{what}|eager", [_EAGER], {_EAGER: eager_s[0]}, {})
        measuring.record(what, requested, seconds, _failures(lowerings, seconds, skipped))
    return ((best[0].name, best[1]) if best is not None else None, seconds,
            eager_s[0] if seconds else None)


def _against_best(lowerings: Sequence[Lowering], build: _Build,
                  timer: Callable[[Callable[..., Any]], Callable[[], Any]],
                  measuring: _Measuring, what: str, requested: Sequence[str],
                  skipped: dict[str, str],
                  ) -> tuple[tuple[str, Callable[..., Any]] | None, dict[str, float]]:
    """The fastest candidate, each timed against the fastest so far (interleaved) and the
    slower one freed before the next is built (Inductor's and ONNX Runtime's copies: +2 GiB on
    a 194 M-parameter decoder, alive together); the cache keeps the last pair, which holds
    the winner."""
    best: tuple[str, Callable[..., Any]] | None = None
    seconds: dict[str, float] = {}
    for lowering in lowerings:
        run = build(lowering)
        if run is None:
            continue
        if best is None:
            best = (lowering.name, run)
            continue
        log.info("backend: measuring %s against %s", lowering.name, best[0])
        timed: dict[str, Callable[[], Any]] = {}
        try:
            timed = {best[0]: timer(best[1]), lowering.name: timer(run)}
            pair = measuring.timings(what, timed, cache_as=requested)
            winner = lowering.name if replaces(pair[lowering.name], pair[best[0]]) \
                else best[0]
        except Exception as exc:  # noqa: BLE001 - a verified candidate that fails when timed
            # The preferred candidate still runs (both matched eager); the reason is kept.
            skipped[lowering.name] = (f"not measured: timing the candidates raised "
                                      f"{_failure(exc)}")
            winner, pair = best[0], {}
        for name, value in pair.items():
            seconds.setdefault(name, value)
        if winner == lowering.name:
            best = (winner, run)
        # The slower of the two (and its timer): its weights go before the next is built.
        del run, timed
        memory_profile.release_free_memory()
    if len(seconds) > 1:  # every pair's times, where the cache holds only the last pair's
        measuring.record(what, requested, seconds, _failures(lowerings, seconds, skipped))
    return best, seconds


def _unmeasured(lowerings: Sequence[Lowering], stored: dict[str, float]) -> list[str]:
    """The candidates a record holds no time for, other than those it shows were not worth
    building (``dominated_by`` a candidate it measured)."""
    return [lw.name for lw in lowerings if lw.name not in stored
            and not (lw.dominated_by is not None and lw.dominated_by[0] in stored)]


def _failures(lowerings: Sequence[Lowering], seconds: dict[str, float],
              skipped: dict[str, str]) -> dict[str, str]:
    """Why each candidate that was tried holds no time in ``seconds``."""
    return {name: skipped.get(name, "failed") for name in _unmeasured(lowerings, seconds)}


def _regions(lowering: Lowering) -> str:
    return lowering.regions() if lowering.regions is not None else ""


def _failure(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {first_line(exc, 240)}"
