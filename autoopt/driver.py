"""Run the passes over a graph: each on a private copy, linted, checked, rolled back on failure.

By default the result of the whole pipeline is verified once; only when that fails (and the
captured graph itself passes) are the passes re-run one at a time with a check after each, so
the failing pass is found, named and left out while the others still apply. ``debug=True``
checks after every pass from the start.
"""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Callable, Sequence

from torch.fx import GraphModule

from . import memory_profile
from .passes import LOWERING, PassContext, PassFn
from .report import PassRecord
from .verify import VerifyResult

log = logging.getLogger(__name__)

Check = Callable[[GraphModule], VerifyResult]


def copy_graph_module(gm: GraphModule) -> GraphModule:
    """A module with its own graph (so a pass can rewrite it) sharing gm's tensors and
    submodules (so the copy costs no parameter memory)."""
    graph = copy.deepcopy(gm.graph)
    new = GraphModule(gm, graph, class_name=type(gm).__name__)
    new.meta = dict(getattr(gm, "meta", {}))
    return new


def run_pipeline(gm: GraphModule, passes: Sequence[tuple[str, PassFn]], ctx: PassContext,
                 check: Check | None, *, disabled: Sequence[str] = (), debug: bool = False,
                 ) -> tuple[GraphModule, list[PassRecord]]:
    """Apply ``passes`` in order and return the final module with one record per pass.

    Args:
        gm: the captured graph; never modified (each pass works on a copy).
        passes: ``(name, fn)`` pairs in the order to run.
        ctx: what the passes may read.
        check: compares a candidate module with the original function; None skips checking.
        disabled: names of passes to skip.
        debug: check after every pass instead of once at the end.
    """
    if check is not None:
        check = _staged(check)
    current, records = _run(gm, passes, ctx, check if debug else None, disabled)
    if check is None or debug or not any(r.status == "applied" for r in records):
        return current, records
    log.info("verifying the optimized graph against eager")
    result = check(current)
    if result.ok:
        return current, records
    if not check(gm).ok:
        # The captured graph itself is not the model's function: no pass is to blame, and
        # the caller, checking ``gm``, rejects the capture.
        return gm, records
    log.warning("optimized graph failed verification (%s); re-running passes one at a time",
                result.detail)
    return _run(gm, passes, ctx, check, disabled)


def _run(gm: GraphModule, passes: Sequence[tuple[str, PassFn]], ctx: PassContext,
         check: Check | None, disabled: Sequence[str]) -> tuple[GraphModule, list[PassRecord]]:
    records: list[PassRecord] = []
    current = gm
    before_lowering: GraphModule | None = None
    for name, fn in passes:
        if name in LOWERING and before_lowering is None:
            before_lowering = current
        if name in disabled:
            records.append(PassRecord(name, "disabled"))
            continue
        log.info("pass %s", name)  # the CLI's progress line shows these
        start = time.perf_counter()
        candidate = copy_graph_module(current)
        options = ctx.options.get(name, {}) if isinstance(ctx.options, dict) else {}
        pass_ctx = PassContext(ctx.example_inputs, ctx.device, ctx.training, ctx.cost, options)
        try:
            with memory_profile.stage(f"pass {name}"):
                result = fn(candidate, pass_ctx)
            if result.modified:
                result.graph_module.graph.lint()
                result.graph_module.recompile()
        except Exception as exc:  # noqa: BLE001 - a broken pass is reported, never fatal
            log.warning("pass %s raised %s: %s; rolled back", name, type(exc).__name__, exc)
            records.append(PassRecord(name, "failed", seconds=time.perf_counter() - start,
                                      reason=f"{type(exc).__name__}: {_first_line(exc)}"))
            continue
        if not result.modified:
            records.append(PassRecord(name, "unchanged", seconds=time.perf_counter() - start))
            continue
        if check is not None:
            verdict = check(result.graph_module)
            if not verdict.ok:
                log.warning("pass %s changed the function (%s); rolled back", name, verdict.detail)
                records.append(PassRecord(name, "rolled_back", dict(result.counts),
                                          time.perf_counter() - start, verdict.detail))
                continue
        current = result.graph_module
        records.append(PassRecord(name, "applied", dict(result.counts),
                                  time.perf_counter() - start))
    if before_lowering is not None and current is not before_lowering:
        current.meta["portable"] = before_lowering
    return current, records


def _staged(check: Check) -> Check:
    def staged(candidate: GraphModule) -> VerifyResult:
        with memory_profile.stage("verify"):
            return check(candidate)
    return staged


def portable(gm: GraphModule) -> GraphModule:
    """The graph to export for ``gm``: the last one before device-specific lowering passes
    (``autoopt.passes.LOWERING``), which a file for another runtime cannot hold."""
    return gm.meta.get("portable", gm)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:300] if text else ""
