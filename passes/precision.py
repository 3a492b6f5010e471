"""Run compute-heavy ops in bf16/fp16 (or linears in int8), keeping fp32 where measurement says
accuracy needs it.

    x ─ linear ─ gelu ─ linear ─ add(x) ─ layer_norm ─ ...                    (fp32)
                                  ⟶
    x ─ to(bf16) ─ linear ─ gelu ─ linear ─ to(fp32) ─ add(x) ─ layer_norm ─ ...

Starting policy: matmuls, convolutions and attention in low precision, sensitive ops (norms,
softmax, reductions, exp/log/pow, losses, cumulative ops) in fp32, the rest following their
inputs (``precision_cast``). Then, by measurement on the example inputs: when the whole-graph
error (its outputs', and the inputs' it writes: a KV cache) exceeds the budget (half the
tolerance), groups of neighbouring candidates are run alone in low precision and the worst go
back to fp32 until the graph fits (``choose``). What was chosen, and why, goes into
``gm.meta["precision"]`` for the report.

In training (``ctx.training``) no error is measured per op: autocast's ops run low where the
cost model measures them faster (``precision_policy``), and verification against fp32 over the
whole step is the check.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.fx import GraphModule, Interpreter, Node
from torch.utils import _pytree as pytree

from autoopt.cost_model.isolation import preserved

from . import ops, precision_policy
from .base import PassContext, PassResult
from .graph import written_placeholders
from .masked_inputs import masked_variants
from .precision_cast import (
    CastInterpreter,
    apply_casts,
    candidates,
    functionalize_inplace,
    is_aten_graph,
    out_of_range,
    range_refusal,
)
from .precision_int8 import (
    DYNAMIC,
    FASTER,
    KERNEL,
    KERNEL_NAMES,
    KERNELS,
    Int8Interpreter,
    apply_int8,
    group_size,
    int8_candidates,
    int8_engine,
    is_linear,
    kernels_for,
    slower,
    slower_than_fp32,
    weight_only_bf16,
    why_no_candidate,
)
from .precision_policy import AUTOCAST_LOW, FP32_BY_PRACTICE, training_choice
from .weight_only import TIE, Agreement, agreement, logits_outputs

log = logging.getLogger(__name__)

LOW_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
PRECISIONS = ("fp32", "bf16", "fp16", "int8", "int4")
# End-to-end relative error allowed when the user gives no tolerance. int4's weights err by
# about 8% each (16 levels over a group's range): a 12-layer decoder with random weights errs
# 15-30% in its logits on the example tokens (134M Llama-style; a 2-layer one 12-20%), 52% on
# random ones in verification, so that at 0.5 most linears stayed fp32 (half the tolerance on
# the examples) or verification rolled int4 back. Where the graph has token logits,
# next-token agreement (MIN_AGREEMENT) is what judges it.
DEFAULT_TOLERANCE = {"bf16": 2e-2, "fp16": 1e-2, "int8": 5e-2, "int4": 0.9}
# The same for a model that generates (transformers' ``generate``), whose precision its
# next-token agreement judges: the tolerance only rules out the grossly wrong. bf16 on every
# linear of an 8-layer random-weight Llama-style decoder errs 1.0% in its logits and 1.1% in
# its KV cache, over half the default's 2%: 21 of its decode step's 41 linears stayed fp32
# and it decoded no faster than fp32 (31.7 against 24.1 tokens/s with all in bf16, 1 thread,
# Intel Xeon with AMX); int8 kept 28 of 41 at 5%.
DECODER_TOLERANCE = {"bf16": 5e-2, "fp16": 5e-2, "int8": 0.2, "int4": 0.9}
# Next-token agreement with fp32 (teacher forcing, on the example inputs) below which a
# quantized decoder is refused, unless the precision pass's ``min_agreement`` option says
# otherwise; judged where the logits hold at least MIN_POSITIONS positions (fewer, as in a
# decode step's single token, are reported but would judge by one or two near-ties).
MIN_AGREEMENT = {"bf16": 0.95, "fp16": 0.95, "int8": 0.95, "int4": 0.90}
MIN_POSITIONS = 16
# Ends the note of a decoder's graph that int8/int4 measured slower on (its prompt's many rows
# per weight): the model's decode steps, one row each, are measured and judged by their own
# graphs (``options.precision.check_applied`` does not raise for this graph alone).
DECODE_DECIDES = "a decode step's graph measures its own linears"
# The same for a training step (outputs and gradients against eager fp32): what autocast itself
# errs by, with margin. Measured, train-mode resnet18 from random init, batch 8: autocast bf16
# 3.8% on outputs, 3.6% on gradients in verification's units (tiny GPT-2: 0.4%), over 2e-2.
DEFAULT_TRAINING_TOLERANCE = {"bf16": 8e-2, "fp16": 2e-2}
# Share of the tolerance the example inputs may use: fresh inputs verified later may err more.
_MARGIN = 0.5
# Candidates are measured alone in at most this many groups of neighbours (each a whole-graph
# run), and at most this many sent back to fp32 are retried one by one.
_MAX_GROUPS = 8
_MAX_RETRIES = 8


@dataclass(frozen=True)
class KeptOp:
    """An op left in fp32, and why."""

    node: str
    op: str
    why: str


@dataclass(frozen=True)
class PrecisionSummary:
    """What the precision pass chose, for the report.

    Args:
        precision: ``bf16``, ``fp16`` or ``int8``.
        tolerance: the end-to-end relative error allowed (max |error| / max |fp32 output|).
        achieved_error: that error on the example inputs with the chosen casts.
        low_ops: compute-heavy ops now running in low precision.
        kept: ops left in fp32: sensitive by policy, or by measurement.
        casts: cast nodes inserted.
        params_stored_low: parameters stored once in low precision.
        trials: whole-graph runs the measurement took.
        masked_sets: copies of the example inputs with masked positions (``masked_variants``)
            that ``achieved_error`` covers too.
        clamped: attention masks clamped into the low precision's range.
        training: chosen by the training policy (``precision_policy``: autocast's ops, fp32
            master weights, speed measured) rather than by measured error.
        low: the op of each node running in low precision (for the report), by node name.
        kernels: int8/int4: how many linears each quantized kernel computes, by its name.
        group: int4's group size.
        agreement: inference on a graph with token logits: next-token agreement with fp32
            given the same tokens, and the largest logit error.
        min_agreement: the agreement required (judged from ``MIN_POSITIONS`` positions).
    """

    precision: str
    tolerance: float
    achieved_error: float
    low_ops: int
    kept: tuple[KeptOp, ...]
    casts: int = 0
    params_stored_low: int = 0
    trials: int = 0
    masked_sets: int = 0
    clamped: int = 0
    training: bool = False
    low: tuple[tuple[str, str], ...] = ()
    kernels: tuple[tuple[str, int], ...] = ()
    group: int | None = None
    agreement: Agreement | None = None
    min_agreement: float | None = None

    def lines(self, limit: int = 12) -> list[str]:
        masked = f" and {self.masked_sets} masked input set(s)" if self.masked_sets else ""
        clamped = (f", {self.clamped} attention mask(s) clamped to {self.precision}'s range"
                   if self.clamped else "")
        head = (f"precision {self.precision}: {self.low_ops} op(s) in {self.precision}, "
                f"{len(self.kept)} kept in fp32; error {self.achieved_error:.3g} on the "
                f"example inputs{masked} (tolerance {self.tolerance:g}); {self.casts} cast(s)"
                f"{clamped}, {self.params_stored_low} parameter(s) stored in {self.precision}")
        if self.training:
            scaler = (" (scale the loss: torch.amp.GradScaler)" if self.precision == "fp16"
                      else "")
            head += (f"; training: autocast's ops in {self.precision}, fp32 master weights"
                     f"{scaler}")
        rows = []
        if self.low:
            by_op: dict[str, int] = {}
            for _, op in self.low:
                by_op[op] = by_op.get(op, 0) + 1
            rows.append(f"  {self.precision}: " + ", ".join(
                f"{op} x{count}" if count > 1 else op for op, count in by_op.items()))
        if self.kernels:
            group = f" (groups of {self.group})" if self.group else ""
            rows.append("  kernels: " + ", ".join(f"{KERNEL_NAMES.get(k, k)} x{count}"
                                                  for k, count in self.kernels) + group)
        if self.agreement is not None:
            rows.append("  " + agreement_line(self.agreement, self.min_agreement))
        rows += [f"  fp32 {k.node} ({k.op}): {k.why}" for k in self.kept[:limit]]
        if len(self.kept) > limit:
            rows.append(f"  ... {len(self.kept) - limit} more (report.captures[i].precision)")
        return [head, *rows]


def agreement_line(measured: Agreement, required: float | None) -> str:
    """What the agreement measured, for the report and the refusal."""
    judged = (f"required {required:.0%}" if measured.positions >= MIN_POSITIONS and required
              is not None else f"not judged under {MIN_POSITIONS} positions")
    return (f"next-token agreement with fp32 given the same tokens: {measured.agreement:.1%} "
            f"of {measured.positions} position(s), {measured.decided:.1%} counting fp32's "
            f"near-ties (within {TIE:.0%} of its largest logit) as agreeing ({judged}); "
            f"largest logit error {measured.logit_error:.3g} (fp32 logits up to "
            f"{measured.logit_scale:.3g})")


def cast_precision(gm: GraphModule, ctx: PassContext) -> PassResult:
    """Cast compute-heavy ops to the precision in ``ctx.options["precision"]``.

    Options (set by ``OptimizeConfig(precision=..., tolerance=...)``):
        precision: ``None``/``"fp32"`` (do nothing), ``"bf16"``, ``"fp16"`` or ``"int8"``.
        tolerance: end-to-end relative error budget; default ``DEFAULT_TOLERANCE``.

    Safety: only ``torch.export`` (ATen) graphs, only ops whose floating inputs and outputs
    are fp32, never a value written in place; graph outputs keep their dtype; in training the
    parameters stay fp32 and are cast inside the graph so gradients reach them, and the ops
    are autocast's (``precision_policy``), not chosen by per-op error.
    """
    precision = ctx.options.get("precision")
    if precision in (None, "fp32") or not is_aten_graph(gm):
        return PassResult(gm, False)
    tolerance = float(ctx.options.get("tolerance") or DEFAULT_TOLERANCE[precision])
    if precision in KERNELS or weight_only_bf16(precision, ctx.options):
        return _int8(gm, ctx, tolerance, precision)
    dtype = LOW_DTYPES[precision]
    functionalize_inplace(gm)
    # What the low dtype cannot hold (mask fills of finfo(float32).min) stays fp32.
    wide = out_of_range(gm, dtype, ctx.example_inputs)
    by_name = {n.name: n for n in gm.graph.nodes}
    found = candidates(gm, AUTOCAST_LOW.aten if ctx.training else ops.COSTLY.aten)
    refused = {n.name: why for n in found if (why := range_refusal(n, wide, dtype))}
    nodes = [n for n in found if n.name not in refused]
    if not nodes:
        return PassResult(gm, False, note=(
            f"no matmul, convolution or attention that {precision} can hold"
            + (f" ({len(refused)} refused for values out of its range)" if refused else "")))
    names, kinds = [n.name for n in nodes], [_kind(n) for n in nodes]
    mixed = precision_policy.MIXED_INPUT.aten if ctx.training else frozenset()
    params: dict[str, torch.Tensor] = {}  # low-precision weights, cast once for all trials
    with preserved(gm):  # measuring runs update no BatchNorm statistic, counter or RNG
        measure = _Measure(gm, ctx.example_inputs)

        def error_of(chosen: set[str]) -> float:
            return measure.error(CastInterpreter(gm, chosen, dtype, params, wide, mixed))

        agreed = None
        if ctx.training:  # the field's practice decides; measurement only speed
            chosen, kept = training_choice(nodes, dtype, ctx)
            step, seconds = precision_policy.step_choice(gm, set(chosen), set(names), dtype,
                                                         ctx, wide, mixed)
            low = step or set()
            if seconds and step is not None and step != set(chosen):
                log.info("precision %s: every candidate in %s: the step measures %.3g ms, "
                         "%.3g ms with those that pay alone", precision, precision,
                         seconds["all"] * 1e3, seconds["chosen"] * 1e3)
                kept = {}
            error = error_of(low) if low else 0.0
        else:
            low, kept, error = choose(names, error_of, _MARGIN * tolerance, kinds)
            logits = logits_outputs(gm, is_linear)
            agreed = measure.agreement(CastInterpreter(gm, low, dtype, params, wide, mixed),
                                       logits) if low and logits else None
            refusal = _agreement_refusal(precision, agreed, ctx.options)
            if refusal:
                return PassResult(gm, False, note=refusal)
    if not low:
        if ctx.training:
            cast_s = seconds.get("all", seconds.get("chosen"))
            measured = (f": the training step measures {cast_s * 1e3:.3g} ms with "
                        f"{precision} casts against {seconds['fp32'] * 1e3:.3g} ms in fp32"
                        if cast_s and seconds.get("fp32") else "")
            why = (f"no op measured faster in {precision} than in fp32, alone or in the "
                   f"whole training step with its casts (training){measured}")
        else:
            why = (f"no compute-heavy op runs in {precision} within the tolerance "
                   f"{tolerance:g} (inference)")
        log.info("precision %s: %s", precision, why)
        return PassResult(gm, False, note=why)
    low_ops = tuple((n.name, _op(n)) for n in nodes if n.name in low)
    plan = apply_casts(gm, low, dtype, store_params=not ctx.training, wide=wide, mixed=mixed)
    # Where a huge value enters (a fill, a factor, an input): not every op it flows through.
    sources = [n for n in wide if by_name[n].op == "call_function" and n not in refused
               and not any(a.name in wide and a.op == "call_function"
                           for a in by_name[n].all_input_nodes)]
    kept_ops = [KeptOp(n, _op(by_name[n]), why) for n, why in refused.items()]
    kept_ops += [KeptOp(n, _op(by_name[n]), range_refusal(by_name[n], wide, dtype) or "")
                 for n in sources]
    kept_ops += [KeptOp(n, _op(by_name[n]), why) for n, why in kept.items()]
    low_ops += tuple((n.name, f"{_op(n)} (fp32 weights and statistics)")
                     for n in gm.graph.nodes if n.target in mixed and n.name in plan.low_nodes)
    policy = FP32_BY_PRACTICE if ctx.training else "numerically sensitive (policy)"
    kept_ops += [KeptOp(n.name, _op(n), policy)
                 for n in gm.graph.nodes if n.target in ops.SENSITIVE.aten
                 and n.name not in plan.low_nodes]
    gm.meta["precision"] = PrecisionSummary(
        precision, tolerance, error, len(low), tuple(kept_ops), plan.casts,
        plan.params_stored_low, measure.trials, measure.masked_sets, plan.clamped, ctx.training,
        low_ops, agreement=agreed,
        min_agreement=_required(precision, ctx.options) if agreed is not None else None)
    return PassResult(gm, True, {f"{precision}_ops": len(low), "casts": plan.casts,
                                 "kept_fp32": len(kept) + len(refused)})


def choose(names: Sequence[str], error_of: Callable[[set[str]], float], budget: float,
           kinds: Sequence[Hashable] | None = None) -> tuple[set[str], dict[str, str], float]:
    """Pick which candidates run in low precision.

    All of them when the whole graph fits the budget. Otherwise each group of candidates is
    measured alone in low precision (``_groups``: the same op of each repeated block, or
    neighbours); groups go back to fp32 worst first (more at
    a time each round) until the graph fits; then the ops of the groups sent back are tried in
    low precision again one at a time, so only those that need it stay fp32.

    Args:
        names: candidate node names, in graph order.
        error_of: the end-to-end relative error with these candidates in low precision.
        budget: the error allowed.
        kinds: per candidate, what it is (op and shapes), to find repeated blocks.
    Returns:
        (names to run low, {name kept in fp32: why}, the error of the chosen set); an empty
        set when no candidate fits.
    """
    low = set(names)
    error = error_of(low)
    if error <= budget:
        return low, {}, error
    groups = _groups(names, kinds)
    alone = {g: error_of(set(g)) for g in groups}
    kept: dict[str, str] = {}
    for group in groups:  # over budget on its own (or overflowing): no set containing it fits
        if alone[group] > budget:
            kept.update({n: f"alone adds error {alone[group]:.3g} > {budget:.3g}" for n in group})
    # Rounding errors from different ops add roughly in quadrature: calibrated on the measured
    # error, that model says how many of the worst groups must go back to fp32 (then checked).
    remaining = sorted((g for g in groups if alone[g] <= budget), key=lambda g: -alone[g])
    if len(remaining) < len(groups):
        low = {n for g in remaining for n in g}
        error = error_of(low) if low else math.inf
    while remaining and error > budget:
        energy = sum(alone[g] ** 2 for g in remaining)
        scale = error / math.sqrt(energy) if energy > 0 else math.inf
        count = 0
        while count < len(remaining) - 1 and scale * math.sqrt(energy) > budget:
            energy -= alone[remaining[count]] ** 2
            count += 1
        for group in remaining[:max(count, 1)]:
            kept.update({n: f"its group alone adds error {alone[group]:.3g}; kept so the "
                            f"graph fits {budget:.3g}" for n in group})
        remaining = remaining[max(count, 1):]
        low = {n for g in remaining for n in g}
        error = error_of(low) if low else math.inf
    if not low:
        return set(), kept, error
    hopeless = {g[0] for g in groups if len(g) == 1 and alone[g] > budget}
    retry = [n for n in names if n in kept and n not in hopeless]
    for name in retry[:_MAX_RETRIES]:
        trial = error_of(low | {name})
        if trial <= budget:
            low, error = low | {name}, trial
            del kept[name]
        else:
            kept[name] = (f"in low precision the graph's error would be {trial:.3g} > "
                          f"{budget:.3g}")
    return low, kept, error


def _int8(gm: GraphModule, ctx: PassContext, tolerance: float,
          precision: str = "int8") -> PassResult:
    """int8 (dynamic or weight-only, per linear) or int4 (weight-only) linears."""
    # Safety: inference only (a quantized linear has no gradient) and a quantized engine exists.
    if ctx.training or ctx.device.type != "cpu" or (precision == "int8"
                                                    and int8_engine() is None):
        return PassResult(gm, False)
    candidates = int8_candidates(gm, precision, ctx.options)
    if not candidates:
        return PassResult(gm, False, note=why_no_candidate(gm, precision, ctx.options))
    slow = slower_than_fp32(gm, ctx, candidates)
    nodes = [n for n in candidates if n.name not in slow]
    # Unmeasured: the precision's first kernel that fits (the kernel option's, if given).
    unmeasured = {n.name: kernels_for(gm, n, precision, ctx.options)[0] for n in candidates}
    kernel_of = {n.name: n.meta.get(KERNEL, unmeasured[n.name]) for n in candidates}
    group = group_size(ctx.options)
    logits = logits_outputs(gm, is_linear)
    packed: dict[Any, Any] = {}  # quantized weights, packed once for all trials and the result

    def run(chosen: set[str]) -> Interpreter:
        return Int8Interpreter(gm, {n: kernel_of[n] for n in chosen}, packed, group)

    if not nodes:
        first = next(iter(slow.values()), "").removeprefix(slower(precision))
        why = (f"{precision} measured slower than fp32 on each of the {len(slow)} linear(s) "
               f"(the first: {first})")
        if slow and logits:
            # A decoder's forward over a prompt: at many rows per weight the quantized kernels
            # lose, at a decode step's one row they read a quarter or an eighth of fp32's
            # bytes (int4 forced on every linear of a 134M Llama-style decoder: 3.6x eager's
            # tokens/s, where at the 32-row example it measured 1.5x slower). Its decode steps
            # measure for themselves; their quality is judged here, on all the positions.
            with preserved(gm):
                # Judged on the example alone: no masked copies, whose error nothing reads.
                measure = _Measure(gm, ctx.example_inputs, masked=False)
                agreed = measure.agreement(run(set(kernel_of)), logits)
            refusal = _agreement_refusal(precision, agreed, ctx.options)
            return PassResult(gm, False, note=refusal or f"{why} here; {DECODE_DECIDES}")
        return PassResult(gm, False, note=(
            f"{why}; pass_options={{'precision': {{'force': True}}}} quantizes anyway, or drop "
            f"precision=") if slow else "")
    names, kinds = [n.name for n in nodes], [_kind(n) for n in nodes]

    with preserved(gm):
        measure = _Measure(gm, ctx.example_inputs)
        low, kept, error = choose(names, lambda s: measure.error(run(s)), _MARGIN * tolerance,
                                  kinds)
        # The dynamic kernel quantizes activations too; the weight-only one errs less. Where
        # the error kept dynamic linears in fp32, try those the weight-only kernel also runs
        # faster than fp32 (or all, unmeasured) with it, and keep the choice that quantizes more.
        switch = {n.name for n in nodes if n.name in kept and kernel_of[n.name] in DYNAMIC
                  and "int8_weight" in n.meta.get(FASTER, kernels_for(gm, n, precision,
                                                                      ctx.options))}
        if switch:
            first = dict(kernel_of)
            kernel_of.update(dict.fromkeys(switch, "int8_weight"))
            retry = choose(names, lambda s: measure.error(run(s)), _MARGIN * tolerance, kinds)
            if len(retry[0]) > len(low):
                low, kept, error = retry
            else:
                kernel_of = first
        agreed = measure.agreement(run(low), logits) if low and logits else None
    if not low:
        return PassResult(gm, False, note=(
            f"each linear in {precision} errs past the tolerance {tolerance:g}: pass a larger "
            f"tolerance=, or drop precision="))
    refusal = _agreement_refusal(precision, agreed, ctx.options)
    if refusal:
        return PassResult(gm, False, note=refusal)
    required = _required(precision, ctx.options)
    kept.update(slow)
    op_names = {n.name: _op(n) for n in gm.graph.nodes}
    chosen = {n: kernel_of[n] for n in names if n in low}
    replaced = apply_int8(gm, chosen, packed, group)
    counts: dict[str, int] = {}
    for kernel in chosen.values():
        counts[kernel] = counts.get(kernel, 0) + 1
    gm.meta["precision"] = PrecisionSummary(
        precision, tolerance, error, replaced,
        tuple(KeptOp(n, op_names[n], why) for n, why in kept.items()), params_stored_low=replaced,
        trials=measure.trials, masked_sets=measure.masked_sets,
        kernels=tuple(sorted(counts.items())),
        group=group if {"int4", "int4_blocks"} & counts.keys() else None,
        agreement=agreed, min_agreement=required)
    return PassResult(gm, True, {f"{precision}_linear": replaced, "kept_fp32": len(kept),
                                 **{f"{k}_kernel": c for k, c in counts.items()}})


def _required(precision: str, options: Mapping[str, Any]) -> float:
    """The next-token agreement required: the ``min_agreement`` option's, or the default."""
    return float(options.get("min_agreement", MIN_AGREEMENT[precision]))


def _agreement_refusal(precision: str, agreed: Agreement | None,
                       options: Mapping[str, Any]) -> str | None:
    """Why ``precision`` is refused for its next-token agreement with fp32, or None where it
    agrees enough or too few positions judge it."""
    required = _required(precision, options)
    if agreed is None or agreed.positions < MIN_POSITIONS or agreed.decided >= required:
        return None
    other = {"int4": "use precision='int8', or ", "int8": "use precision='bf16', or "}.get(
        precision, "")
    accept = math.floor(agreed.decided * 100) / 100  # rounded down: accepted when passed
    return (f"{precision}'s {agreement_line(agreed, required)}, below the required "
            f"{required:.0%}: {other}drop precision= for fp32, or accept it with "
            f"pass_options={{'precision': {{'min_agreement': {accept:g}}}}}")


class _Measure:
    """Runs candidate graphs on the example inputs, and on copies of them with masked
    positions (``masked_variants``; not with ``masked`` False), and compares them with the
    fp32 graph.

    One snapshot (the caller's ``preserved``) covers all runs: what they write (BatchNorm
    statistics in training) does not reach the outputs compared, and a snapshot per run would
    copy every folded weight each time.
    """

    def __init__(self, gm: GraphModule, example_inputs: Sequence[Any],
                 masked: bool = True) -> None:
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        if len(example_inputs) != len(placeholders):
            raise ValueError("the precision pass measures on the example inputs, but they do "
                             f"not match the graph's {len(placeholders)} placeholder(s)")
        # The inputs the graph writes (a KV cache at the step's positions) are results too:
        # verification holds them to the tolerance, so the budget must count them.
        self.written = sorted(written_placeholders(gm))
        self.trials = 0
        self.sets = [tuple(example_inputs)]
        self.references = [self._run(Interpreter(gm), self.sets[0])]
        for inputs in masked_variants(self.sets[0]) if masked else ():
            try:
                reference = self._run(Interpreter(gm), inputs)
            except Exception as e:  # noqa: BLE001 - not a mask after all (an index, a size)
                log.debug("precision: no measuring on a masked copy of the inputs: %s", e)
                continue
            self.sets.append(inputs)
            self.references.append(reference)

    @property
    def masked_sets(self) -> int:
        return len(self.sets) - 1

    def error(self, candidate: Interpreter) -> float:
        """Max over input sets and floating outputs (and inputs written) of ``max |actual -
        expected| / max |expected|``; where fp32 gives inf or NaN (a fully masked row) the
        candidate must too."""
        self.trials += 1
        worst = 0.0
        for inputs, reference in zip(self.sets, self.references, strict=True):
            for e, a in zip(reference, self._run(candidate, inputs), strict=True):
                if isinstance(e, torch.Tensor) and e.is_floating_point() and e.numel():
                    worst = max(worst, _relative_error(e, a))
                if worst == math.inf:
                    return worst
        return worst

    def agreement(self, candidate: Interpreter, logits: Sequence[int]) -> Agreement | None:
        """``candidate``'s next-token agreement with the fp32 graph on the example inputs, over
        the logits leaves ``logits`` (``logits_outputs``)."""
        return agreement(self.references[0], self._run(candidate, self.sets[0]), logits)

    def _run(self, interpreter: Interpreter, inputs: tuple[Any, ...]) -> list[Any]:
        """The output leaves, then the inputs the graph wrote (after the outputs, so the
        outputs' indices are the graph's)."""
        # Each run on its own copies: a graph that writes an input in place (a KV cache
        # written at its position, a step counter) would otherwise see the previous run's
        # writes, and the runs would not compute the same thing.
        inputs = tuple(x.clone() if isinstance(x, torch.Tensor) else x for x in inputs)
        with torch.no_grad(), torch.random.fork_rng(), _quiet():
            torch.manual_seed(0)  # dropout in training draws the same masks each run
            out = interpreter.run(*inputs)
        return [*pytree.tree_leaves(out), *(inputs[i] for i in self.written)]


def _relative_error(expected: torch.Tensor, actual: torch.Tensor) -> float:
    e64, a64 = expected.double(), actual.double()
    finite = torch.isfinite(e64)
    if not bool(finite.all()):
        same = (a64 == e64) | (torch.isnan(a64) & torch.isnan(e64))
        if not bool(same[~finite].all()):
            return math.inf
        e64, a64 = e64[finite], a64[finite]
        if not e64.numel():
            return 0.0
    scale = float(e64.abs().max())
    diff = float((a64 - e64).abs().max())
    if math.isnan(diff):  # an overflow (fp16) or NaN: never within any budget
        return math.inf
    return diff / scale if scale > 0 else diff


def _groups(names: Sequence[str], kinds: Sequence[Hashable] | None = None,
            ) -> list[tuple[str, ...]]:
    """Candidates to measure together. In a stack of identical blocks (a transformer's layers)
    the same op of every block forms a group (all query projections, all FFN outputs: ops of
    one role err alike, while neighbours differ), the ops after the last whole block another.
    Otherwise at most ``_MAX_GROUPS`` runs of neighbours."""
    period = _period(kinds) if kinds is not None else None
    if period is not None:
        whole = len(names) // period * period
        groups = [tuple(names[i:whole:period]) for i in range(period)]
        return groups + ([tuple(names[whole:])] if whole < len(names) else [])
    size = max(1, math.ceil(len(names) / _MAX_GROUPS))
    return [tuple(names[i:i + size]) for i in range(0, len(names), size)]


def _period(kinds: Sequence[Hashable]) -> int | None:
    """The length of the block ``kinds`` repeats (at least twice, 2 to ``_MAX_GROUPS`` ops)."""
    for period in range(2, min(_MAX_GROUPS, len(kinds) // 2) + 1):
        whole = len(kinds) // period * period
        if all(kinds[i] == kinds[i + period] for i in range(whole - period)):
            return period
    return None


def _kind(node: Node) -> Hashable:
    shapes = tuple(str(tuple(v.shape)) for a in node.all_input_nodes
                   if isinstance(v := a.meta.get("val"), torch.Tensor))
    return str(node.target), shapes


def _op(node: Node) -> str:
    return str(getattr(node.target, "__name__", node.target))


@contextlib.contextmanager
def _quiet() -> Any:
    # The int8 kernels warn about deprecated quantized tensors on every call.
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        yield
