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

import torch
from torch import nn
from torch.fx import GraphModule

from autoopt.check.compare import VerifyResult
from autoopt.check.report import PassRecord
from autoopt.cost_model.isolation import is_read_only
from autoopt.observe import memory_profile
from autoopt.passes import LOWERING, PassContext, PassFn
from autoopt.passes.graph import add_constant, attr, fake_like
from autoopt.passes.merge_linear import CONCATENATED, MERGED_FROM

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
    # The graph before ``precision`` cast it, where it did: an engine with a reduced-precision
    # mode of its own (OpenVINO's bf16 hint) is a candidate on it (``FULL_PRECISION``).
    before_precision: GraphModule | None = None
    for name, fn in passes:
        if name in LOWERING and before_lowering is None:
            # Merged weights become concatenations of the user's weights here, so that their
            # copies are freed before the lowerings make theirs (packed_linear packs the
            # concatenation); the copies still read are made again after the lowerings.
            current = before_lowering = _as_concatenations(current)
            if before_precision is not None:
                before_precision = _as_concatenations(before_precision)
            candidate = result = None  # the graph before: its merged copies go now
            memory_profile.release_free_memory()
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
                                        or _concatenations(current)):
        if current is before_lowering:
            current = copy_graph_module(current)
        folded = _fold_concatenations(current)
        _drop_unread_constants(current)
        # Where the lowered graph holds a merged weight again, the exported one shares it.
        current.meta["portable"] = before_lowering
        if folded:
            current.meta["portable"] = copy_graph_module(before_lowering)
            _fold_concatenations(current.meta["portable"], folded)
        memory_profile.release_free_memory()
    if before_precision is not None and current is not before_precision:
        current.meta[FULL_PRECISION] = before_precision
    return current, records


def _concatenations(gm: GraphModule) -> list[torch.fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.meta.get(CONCATENATED)]


def _as_concatenations(gm: GraphModule) -> GraphModule:
    """A copy of ``gm`` reading each merged weight (``merge_linear``) as the concatenation of
    the user's weights it stacks, holding no copy of its own: the graph kept for export, and
    the one the lowerings start from. ``gm`` itself where it has no merged weight (or one
    whose sources are gone)."""
    nodes = [n for n in gm.graph.nodes if n.op == "get_attr" and n.meta.get(MERGED_FROM)
             and isinstance(attr(gm, n), torch.Tensor)]
    if not nodes:
        return gm
    new = copy_graph_module(gm)
    by_name = {n.name: n for n in new.graph.nodes}
    first = next(n for n in new.graph.nodes if n.op != "placeholder")
    changed = False
    for old in nodes:
        node = by_name[old.name]
        sources = [(target, ref()) for target, ref in node.meta[MERGED_FROM]]
        if any(t is None or not _has_or_sets(new, target, t) for target, t in sources):
            continue  # a stacked weight is gone or shadowed: keep the merged copy
        with new.graph.inserting_before(first):
            parts = [new.graph.get_attr(target) for target, _ in sources]
        for part, (_, t) in zip(parts, sources, strict=True):
            part.meta["val"] = fake_like(new, t)
        with new.graph.inserting_before(node):
            cat = new.graph.call_function(torch.ops.aten.cat.default, (parts, 0))
        cat.meta = {k: v for k, v in node.meta.items() if k != MERGED_FROM}
        cat.meta[CONCATENATED] = True
        node.replace_all_uses_with(cat)
        new.graph.erase_node(node)
        if str(node.target) not in {str(n.target) for n in new.graph.nodes if n.op == "get_attr"}:
            delattr(new, str(node.target))
        changed = True
    if not changed:
        return gm
    new.recompile()
    return new


def _fold_concatenations(gm: GraphModule, values: dict[str, torch.Tensor] | None = None,
                         ) -> dict[str, torch.Tensor]:
    """Undo ``_as_concatenations`` where a concatenation is still read (a linear left on
    aten): one merged copy again, computed once instead of per call (or taken from
    ``values``, by node name); unread ones go. Returns the merged copies made, by node name."""
    made: dict[str, torch.Tensor] = {}
    for cat in _concatenations(gm):
        parts = list(cat.args[0])
        if cat.users and (values is None or cat.name in values):
            value = (values[cat.name] if values is not None
                     else torch.cat([attr(gm, p).detach() for p in parts]))
            with gm.graph.inserting_before(cat):
                node = add_constant(gm, "merged_linear_weight", value)
            cat.replace_all_uses_with(node)
            made[cat.name] = value
        elif cat.users:
            continue
        gm.graph.erase_node(cat)
        for part in parts:
            if not part.users:
                gm.graph.erase_node(part)
    gm.recompile()
    return made


def _drop_unread_constants(gm: GraphModule) -> None:
    """Take out of ``gm`` the constants passes made (read-only) that no node reads any more:
    a merged weight a lowering packed is held by the packed kernel's copy alone."""
    for node in [n for n in gm.graph.nodes if n.op == "get_attr" and not n.users]:
        value = attr(gm, node)
        if isinstance(value, torch.Tensor) and is_read_only(value):
            gm.graph.erase_node(node)
    read = {str(n.target) for n in gm.graph.nodes if n.op == "get_attr"}
    for name, value in list(gm.named_buffers(recurse=False)):
        if name not in read and is_read_only(value):
            delattr(gm, name)
    gm.recompile()


def _has_or_sets(gm: GraphModule, target: str, tensor: torch.Tensor) -> bool:
    """Whether ``gm`` has ``tensor`` at ``target``, putting it there if nothing is; False
    where another value holds the name."""
    *path, name = target.split(".")
    owner: nn.Module = gm
    for atom in path:
        child = getattr(owner, atom, None)
        if child is None:
            child = nn.Module()
            owner.add_module(atom, child)
        if not isinstance(child, nn.Module):
            return False
        owner = child
    current = getattr(owner, name, None)
    if current is None:
        if isinstance(tensor, nn.Parameter):
            owner.register_parameter(name, tensor)
        else:
            owner.register_buffer(name, tensor)
        return True
    return current is tensor


def _staged(check: Check) -> Check:
    def staged(candidate: GraphModule) -> VerifyResult:
        with memory_profile.stage("verify"):
            return check(candidate)
    return staged


# ``gm.meta[FULL_PRECISION]``: the graph before the ``precision`` pass cast it, where it did.
FULL_PRECISION = "full_precision"


def full_precision(gm: GraphModule) -> GraphModule | None:
    """The graph ``gm`` was before ``precision=`` cast it (portable, as ``portable``'s), or
    None where the precision pass did not change it."""
    return gm.meta.get(FULL_PRECISION)


def portable(gm: GraphModule) -> GraphModule:
    """The graph to export for ``gm``: the last one before device-specific lowering passes
    (``autoopt.passes.LOWERING``), which a file for another runtime cannot hold."""
    return gm.meta.get("portable", gm)


def graph_to_keep(gm: GraphModule, backend: str) -> GraphModule:
    """The graph an optimized module keeps for a specialization (export, inspection): ``gm``
    where it runs the calls (``backend`` empty: aten), else the graph the other backend was
    lowered from (``portable``), without the aten lowerings' packed weight copies that no
    call would read (``hybrid`` calls them: it keeps ``gm``)."""
    return gm if backend in ("", "hybrid") else portable(gm)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:300] if text else ""
