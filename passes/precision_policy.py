"""Training precision by the field's practice: the ops ``torch.autocast`` runs in fp16/bf16 run
low, the ops it keeps in fp32 stay fp32, and measurement decides only speed.

    conv ─ batch_norm ─ relu ─ conv ─ … ─ linear ─ cross_entropy                 (fp32)
                                  ⟶
    to(bf16) ─ conv ─ batch_norm ─ relu ─ conv ─ … ─ linear ─ to(fp32) ─ cross_entropy
    (parameters stay fp32 and are cast inside the graph: fp32 master weights, fp32 gradients;
     batch_norm takes the bf16 activation with its fp32 weights and statistics, as autocast)

Inference measures each op's error and keeps in fp32 what the tolerance cannot afford
(``precision.choose``). Training cannot be judged that way: a bf16 convolution on random weights
errs by 3-10% per op, yet mixed-precision training with exactly these casts converges like fp32
(Micikevicius et al. 2018; every large bf16 run since). So in training the policy is autocast's
(its ``lower_precision_fp`` and ``fp32`` op lists, as op sets below), and the one question
measured is whether the low-precision op, with the casts of its inputs, forward and backward,
is faster than fp32 on this device; where it is not, the op stays fp32 and the report says so.
fp16 gradients underflow without loss scaling: that is the user's ``torch.amp.GradScaler``, as
with autocast.
"""

from __future__ import annotations

import copy
import hashlib
import logging
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.fx import GraphModule, Node
from torch.fx.node import map_arg
from torch.utils import _pytree as pytree

from autoopt.cost_model.estimate import op_name, value_spec

from . import ops
from .base import PassContext
from .graph import meta_val
from .precision_cast import apply_casts, attention_mask

log = logging.getLogger(__name__)

# What autocast runs in fp16/bf16 (its lower_precision_fp list: mm, bmm, addmm, baddbmm, matmul,
# linear, the convolutions and transposed convolutions, scaled_dot_product_attention).
AUTOCAST_LOW = ops.COSTLY
# What it runs in fp32 (its fp32 list): softmax and log-softmax, norms, reductions and
# cumulative sums, exp/log/pow, losses. Every other op follows its inputs' dtype.
AUTOCAST_FP32 = ops.SENSITIVE
# Ops that take a low-precision activation next to fp32 weights and statistics and compute in
# fp32 inside: autocast leaves BatchNorm to its input's dtype (cuDNN and the CPU kernel
# accumulate in fp32, the running statistics stay fp32), so a conv ─ bn ─ relu ─ conv chain
# needs no cast on either side of the norm. Only the first argument follows the region.
MIXED_INPUT = ops.OpSet(frozenset({torch.ops.aten.batch_norm.default}))
# Why an op of AUTOCAST_FP32 stays fp32 in training, for the report.
FP32_BY_PRACTICE = ("fp32 by mixed-precision practice (autocast keeps norms, softmax, "
                    "reductions, exp/log/pow and losses in fp32)")


@dataclass(frozen=True)
class Speed:
    """One op's measured training step (forward and backward) in fp32 and in low precision.

    Args:
        fp32_s: seconds in fp32.
        low_s: seconds in low precision, its inputs' casts included.
    """

    fp32_s: float
    low_s: float

    @property
    def pays(self) -> bool:
        return self.low_s < self.fp32_s


def training_choice(nodes: Sequence[Node], dtype: torch.dtype, ctx: PassContext,
                    ) -> tuple[list[str], dict[str, str]]:
    """Which of the candidate ``nodes`` (autocast's low-precision ops) run in ``dtype``.

    All of them, except those whose low-precision step the cost model measures not faster
    than fp32. ``ctx.options["force"]`` or ``{"measure": False}``, or no cost model, skip the
    measurement (every candidate runs low).

    Returns:
        (names of the nodes to run low, {name kept in fp32: why}).
    """
    if not _measuring(ctx):
        return [n.name for n in nodes], {}
    name = _SHORT.get(dtype, str(dtype))
    low: list[str] = []
    kept: dict[str, str] = {}
    for node in nodes:
        speed = measure_speed(node, dtype, ctx)
        if speed is None or speed.pays:
            low.append(node.name)
        else:
            kept[node.name] = (f"{name} measured not faster here: {speed.low_s * 1e3:.3g} ms "
                               f"vs {speed.fp32_s * 1e3:.3g} ms in fp32 (forward and backward)")
    return low, kept


def step_choice(gm: GraphModule, chosen: set[str], every: set[str], dtype: torch.dtype,
                ctx: PassContext, wide: Collection[str] = (), mixed: Collection[Any] = (),
                ) -> tuple[set[str] | None, dict[str, float]]:
    """The whole graph's training step (forward, and backward to every parameter and input
    that requires grad) timed by the cost model on the example inputs in fp32, with the
    ``chosen`` ops cast, and with ``every`` candidate cast: alone an op may not pay while the
    casts between ops cost more, or, with its neighbours low, no cast is left to pay for.

    Returns:
        (the set to cast, or None to stay fp32; the seconds measured per variant, empty where
        nothing was measured: then ``chosen``).
    """
    if not _measuring(ctx):
        return chosen, {}
    variants: dict[str, set[str]] = {"fp32": set(), "chosen": chosen}
    if every != chosen:
        variants["all"] = every
    graphs = {}
    for key, names in variants.items():
        graphs[key] = GraphModule(gm, copy.deepcopy(gm.graph))
        if names:
            apply_casts(graphs[key], names, dtype, store_params=False, wide=wide, mixed=mixed)
        graphs[key].recompile()
    seconds = step_seconds(graphs, ctx)
    if not seconds:
        return chosen, {}
    best = min(seconds, key=lambda k: (seconds[k], list(seconds).index(k)))  # ties: fp32
    return (variants[best] or None), seconds


def step_seconds(graphs: dict[str, GraphModule], ctx: PassContext) -> dict[str, float]:
    """Seconds of a training step of each graph (all sharing one set of weights), measured
    interleaved by the cost model and cached; empty where they cannot be timed."""
    inputs = tuple(ctx.example_inputs)
    first = next(iter(graphs.values()))
    leaves = [p for p in first.parameters() if p.requires_grad]
    leaves += [x for x in inputs if isinstance(x, torch.Tensor) and x.requires_grad]

    def step(gm: GraphModule) -> Any:
        def run() -> None:
            outs = [o for o in pytree.tree_leaves(gm(*inputs))
                    if isinstance(o, torch.Tensor) and o.requires_grad]
            if outs and leaves:
                torch.autograd.grad(outs, leaves, [torch.ones_like(o) for o in outs],
                                    allow_unused=True)
        return run

    # The graph's code names its weights, not their shapes: those go into the key too.
    weights = [t for t in first.state_dict().values() if isinstance(t, torch.Tensor)]
    code = hashlib.sha1(("".join(g.code for g in graphs.values())
                         + value_spec(weights)).encode()).hexdigest()
    what = f"training step graphs|{code[:20]}|{value_spec(list(inputs))}"
    tensors = [x for x in inputs if isinstance(x, torch.Tensor)]
    try:
        _, seconds = ctx.cost.fastest(what, {k: step(g) for k, g in graphs.items()},
                                      state=[first, *tensors], grad=True, budget_s=5.0)
    except RuntimeError as exc:
        log.info("precision: the training step could not be timed (%s)", exc)
        return {}
    return seconds


def measure_speed(node: Node, dtype: torch.dtype, ctx: PassContext) -> Speed | None:
    """``node``'s forward and backward in fp32 and in ``dtype`` (its floating inputs cast, as
    the graph will cast them), timed by the cost model on random values of the node's shapes
    (cached on disk per op, shapes, dtype and device). None where the node's shapes are not
    concrete (a dynamic graph) or the op cannot run that way."""
    try:
        args, kwargs = _values(node, ctx.device)
    except (TypeError, ValueError, RuntimeError) as exc:
        log.debug("precision: %s not measured (%s)", node.name, exc)
        return None
    leaves = [v for v in pytree.tree_leaves((args, kwargs)) if isinstance(v, torch.Tensor)
              and v.is_floating_point() and v.requires_grad]
    what = (f"training step|{op_name(node.target)}|{value_spec(list(args))}|"
            f"{value_spec(dict(kwargs))}|{dtype}")
    try:
        _, seconds = ctx.cost.fastest(what, {"fp32": _step(node.target, args, kwargs, leaves,
                                                           None),
                                             "low": _step(node.target, args, kwargs, leaves,
                                                          dtype)},
                                      grad=True, budget_s=2.0)
    except RuntimeError as exc:  # no kernel for this dtype (or its backward) here
        log.debug("precision: %s not measured in %s (%s)", node.name, dtype, exc)
        return Speed(fp32_s=0.0, low_s=float("inf"))
    return Speed(seconds["fp32"], seconds["low"])


def _measuring(ctx: PassContext) -> bool:
    """Whether speed is measured: a cost model, and neither ``measure=False`` nor ``force``."""
    return (ctx.cost is not None and bool(ctx.options.get("measure", True))
            and not bool(ctx.options.get("force", False)))


def _values(node: Node, device: torch.device) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Random tensors shaped like ``node``'s inputs (floating ones requiring grad, except an
    attention mask); other arguments as the graph gives them."""
    generator = torch.Generator(device).manual_seed(0)  # the global RNG stays the user's
    mask = attention_mask(node)

    def value(arg: Node) -> Any:
        fake = meta_val(arg)
        if not isinstance(fake, torch.Tensor):
            raise TypeError(f"input {arg.name} is not a tensor")
        shape = tuple(int(d) for d in fake.shape)  # TypeError on a symbolic size
        if fake.is_floating_point():
            t = torch.randn(shape, generator=generator, device=device).to(fake.dtype)
            return t.requires_grad_(arg is not mask)
        if fake.dtype == torch.bool:
            return torch.ones(shape, dtype=torch.bool, device=device)
        return torch.zeros(shape, dtype=fake.dtype, device=device)

    args = map_arg(node.args, value)
    kwargs = map_arg(node.kwargs, value)
    return tuple(args), dict(kwargs)


def _step(target: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
          leaves: list[torch.Tensor], dtype: torch.dtype | None) -> Any:
    """A no-argument callable: ``target`` forward and backward, in ``dtype`` when given."""

    def cast(v: Any) -> Any:
        if dtype is None or not (isinstance(v, torch.Tensor) and v.is_floating_point()):
            return v
        return v.to(dtype)

    def run() -> None:
        out = target(*pytree.tree_map(cast, args), **pytree.tree_map(cast, kwargs))
        outs = [o for o in pytree.tree_leaves(out) if isinstance(o, torch.Tensor)
                and o.requires_grad]
        if outs and leaves:
            torch.autograd.grad(outs, leaves, [torch.ones_like(o) for o in outs],
                                allow_unused=True)

    return run


_SHORT = {torch.bfloat16: "bf16", torch.float16: "fp16"}
