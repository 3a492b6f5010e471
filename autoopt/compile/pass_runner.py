"""Run the passes over a graph: each on a private copy, linted, checked, rolled back on failure.

By default the result of the whole pipeline is verified once; only when that fails (and the
captured graph itself passes) are the passes re-run one at a time with a check after each, so
the failing pass is found, named and left out while the others still apply. ``debug=True``
checks after every pass from the start.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

from torch.fx import GraphModule

from autoopt.check.compare import VerifyResult
from autoopt.check.report import PassRecord
from autoopt.errors import first_line
from autoopt.observe import memory_profile
from autoopt.passes import LOWERING, PassContext, PassFn
from autoopt.passes.graph import (
    FULL_PRECISION,
    copy_graph_module,
    drop_unread_constants,
    realized,
)
from autoopt.passes.merge_linear import as_concatenations, concatenations, fold_concatenations

log = logging.getLogger(__name__)

Check = Callable[[GraphModule], VerifyResult]


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
    # The graph before ``precision`` cast it, where it did: an engine with a reduced-precision
    # mode of its own (OpenVINO's bf16 hint) is a candidate on it (``FULL_PRECISION``).
    before_precision: GraphModule | None = None
    for name, fn in passes:
        if name in LOWERING and before_lowering is None:
            # Merged weights become concatenations of the user's weights here, so that their
            # copies are freed before the lowerings make theirs (packed_linear packs the
            # concatenation); the copies still read are made again after the lowerings.
            current = before_lowering = as_concatenations(current)
            if before_precision is not None:
                before_precision = as_concatenations(before_precision)
            candidate = result = None  # the graph before: its merged copies go now
            memory_profile.release_free_memory()
        if name in disabled:
            records.append(PassRecord(name, "disabled"))
            continue
        log.info("pass %s", name)  # the CLI's progress line shows these
        start = time.perf_counter()
        candidate = copy_graph_module(current, lazy=True)
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
                                      reason=f"{type(exc).__name__}: {first_line(exc)}"))
            continue
        if not result.modified:
            records.append(PassRecord(name, "unchanged", seconds=time.perf_counter() - start,
                                      reason=result.note))
            continue
        if check is not None:
            verdict = check(result.graph_module)
            if not verdict.ok:
                log.warning("pass %s changed the function (%s); rolled back", name, verdict.detail)
                records.append(PassRecord(name, "rolled_back", dict(result.counts),
                                          time.perf_counter() - start, verdict.detail))
                continue
        if name == "precision":
            before_precision = current
        current = result.graph_module
        records.append(PassRecord(name, "applied", dict(result.counts),
                                  time.perf_counter() - start))
    if before_lowering is not None and (current is not before_lowering
                                        or concatenations(current)):
        if current is before_lowering:
            current = copy_graph_module(current)
        folded = fold_concatenations(current)
        drop_unread_constants(current)
        # Where the lowered graph holds a merged weight again, the exported one shares it.
        current.meta["portable"] = before_lowering
        if folded:
            current.meta["portable"] = copy_graph_module(before_lowering)
            fold_concatenations(current.meta["portable"], folded)
        memory_profile.release_free_memory()
    if before_precision is not None and current is not before_precision:
        current.meta[FULL_PRECISION] = realized(before_precision)
    if "portable" in current.meta:
        realized(current.meta["portable"])
    return realized(current), records


def _staged(check: Check) -> Check:
    def staged(candidate: GraphModule) -> VerifyResult:
        with memory_profile.stage("verify"):
            return check(candidate)
    return staged
