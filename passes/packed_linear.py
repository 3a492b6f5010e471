"""Linear layers onto a packed GEMM, MKL's or oneDNN's, with each weight packed once (CPU
inference).

    x ─ linear(W, b) ─ y         ⟶   x ─ mkl_linear(W', b) ─ y    or  onednn_linear(W', b)
    x ─ addmm(b, x, Wᵀ) ─ y      ⟶   x ─ mkl_linear(W', b) ─ y     (GPT-2's Conv1D)
    x ─ mm(x, Wᵀ) ─ y            ⟶   x ─ mkl_linear(W', None) ─ y

``W'`` is ``W`` packed once for this many rows of ``x``, in one of two layouts:

* ``mkl``: MKL's packed GEMM layout (``cblas_sgemm_pack``), run by ``mkl._mkl_linear``. Eager
  ``aten.linear`` runs the same MKL GEMM but repacks panels of ``W`` on every call; with the
  packing done once, BERT's and ViT's linear shapes measured 5–10% faster at 1024 rows and
  20–28% at 128 (1 thread) on a Sapphire Rapids, bitwise equal to ``aten.linear`` there (one
  ulp apart on an AMD EPYC at 2 threads, where MKL splits the reduction differently).
* ``onednn``: oneDNN's blocked layout (``mkldnn._reorder_linear_weight``), run by
  ``mkldnn._linear_pointwise``: the kernels TorchInductor's CPU freezing uses. Another GEMM,
  so it differs from ``aten.linear`` within fp32 rounding (max error against fp64 about twice
  ATen's on the shapes below, ~5e-6 at K = 3072).

Measured on an AMD EPYC (AVX-512 with BF16, no AMX; ``python bench/linear_kernels.py``),
GFLOP/s of ATen / MKL packed / oneDNN packed, median of interleaved rounds:

    rows × in × out      1 thread         2 threads
    128 × 768 × 768      109 / 109 / 248  219 / 216 / 501
    128 × 768 × 3072     104 / 105 / 232  199 / 198 / 455
    128 × 3072 × 768     106 / 106 / 234  209 / 207 / 468
    1024 × 768 × 768     113 / 113 / 256  233 / 233 / 517
    1024 × 768 × 3072    112 / 113 / 254  216 / 222 / 473
    1024 × 3072 × 768    117 / 115 / 263  222 / 223 / 473

There MKL's packed GEMM gains nothing over ATen (both run MKL's sgemm) and oneDNN runs
2.1–2.3× faster; on the Sapphire Rapids MKL packed beat ATen (oneDNN was not measured there).
Hence the choice is measured: where a cost model is present, each distinct
shape keeps whichever of ATen (the node left as it is), MKL packed and oneDNN packed it
measures fastest on this machine, among the kernels this build has. Without one, every
eligible linear gets the ``kernel`` option's kernel (default ``mkl``, as before oneDNN was a
candidate; nothing when the build lacks it).

For a linear of at most ``ROWS_KERNEL_MAX`` rows (a decode step's) on a contiguous ``(out, in)``
weight, autoopt's own fp32 GEMVs are candidates too (``block_kernels``): ``fp32_rows``, 8
weight rows streamed at once, prefetched, and ``fp32_stream``, one row after another with no
software prefetch. They read the weight as it is, no copy. On a quiet Intel Xeon without AMX
the first measured 0.98-1.08x the speed of ATen's MKL GEMV on a decode step's shapes; on an
AMD EPYC (Zen 5) the prefetch costs and the second reads 25-33 GB/s where the first reads
19-28 and oneDNN's packed 20-28 (``bench/decode_gemv.py``): candidates, measured per shape,
not defaults.

The price is memory: the packed copy is about the weight's size, held next to the original
(which the graph shares with the user's model); the pass reports it as ``packed_mib``, and
how many linears each kernel got as ``mkl`` and ``onednn`` (``linear`` counts both,
``linear_kept_aten`` those measured fastest left on ATen).

A row count left symbolic (a graph captured with ``dynamic=``: a prompt of any length) is
measured at the sizes the graph was traced with, among the kernels that serve any count:
ATen and oneDNN (MKL's packed GEMM runs only at the count it packed for). oneDNN's layout
depends on the weight alone, so the graphs of one model (its example call, a decode step, a
prompt step) call one oneDNN copy of each weight: a new one is packed only where the
weight's address, version or sampled values differ (written since).

Each packed copy (and, while a shape is first measured, one per candidate kernel) is checked
against the memory optimize may still add (``optimize_memory``, or what is free:
``autoopt.cost_model.allowance``); a linear whose copies would not fit stays on ATen,
counted as ``kept_for_memory``.

fp32 linears, and bf16 ones (``precision="bf16"`` stores their weights in bf16) onto oneDNN or
FBGEMM's fp16 GEMM (``packed_kernels``), on a CPU build with MKL or oneDNN, not in training
(the packed copy is a constant that gradients would not reach). In bf16 ATen's linear is slower
than oneDNN's packed one: 1 thread, an Intel Xeon with AMX, one row, a 768x32000 output
projection took 7.5 ms in ATen against 2.3 ms packed with the weight in cache, 9.2 against 7.6
ms streamed from memory as a decode step reads it (fp32: 8.5 ms and about 12 ms). It is a
lowering: exports take the graph from before it (``autoopt.passes.LOWERING``).
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch.fx import GraphModule, Node
from torch.fx.experimental.symbolic_shapes import is_concrete_int

from autoopt.cost_model import allowance as memory
from autoopt.cost_model.device import cpu_cache_bytes
from autoopt.cost_model.isolation import is_read_only

from . import ops
from .base import PassContext, PassResult
from .graph import attr, call_kwargs, constant_tensor, has_symbolic_size, meta_val, size_hints
from .merge_linear import CONCATENATED
from .packed_kernels import (
    DTYPES,
    KERNELS,
    OWN_GEMV,
    Concatenation,
    PackedLinear,
    available,
    fits_fp16,
    kernels,
    kernels_for,
    rows_kernel_fits,
)

__all__ = ["KERNELS", "PackedLinear", "against_fp32", "available", "kernels", "packed_linear",
           "weights_outgrow_cache"]

log = logging.getLogger(__name__)

aten = torch.ops.aten


@dataclass(frozen=True)
class _Linear:
    node: Node
    input: Node
    weight: torch.Tensor  # (out, in), as F.linear takes it
    bias: Node | None
    rows: int
    derived: bool = False  # a constant a pass made (read-only), not the model's own weight
    cold: bool = False  # read from memory on every call, and bound by that read (_COLD_ROWS)
    source: Callable[[], torch.Tensor] | None = None  # makes a merged weight again
    # The row count is symbolic (``dynamic=``): ``rows`` and ``shape`` are the sizes it was
    # traced with, where it is measured; any other count runs through the same kernel.
    dynamic: bool = False
    shape: tuple[int, ...] = ()  # the input's, as measured

    def kernel(self, name: str) -> PackedLinear:
        return PackedLinear(self.weight, self.rows, name, self.derived, self.source)

    @functools.cached_property
    def fits_rows_kernel(self) -> bool:
        return rows_kernel_fits(self.weight, self.rows)

    @functools.cached_property
    def fits_fp16(self) -> bool:
        # A read of the whole weight: once, though the choice asks for it several times.
        return fits_fp16(self.weight)


def packed_linear(gm: GraphModule, ctx: PassContext) -> PassResult:
    """Rewrite fp32 (and bf16) linear layers with constant weights (``linear``, and
    ``addmm``/``mm`` on a constant right-hand matrix) to a packed GEMM (MKL's or oneDNN's; bf16
    oneDNN's or FBGEMM's fp16 one) on a weight packed once, where the cost model measures one
    faster than ATen.

    Options (``pass_options={"packed_linear": {...}}``): ``measure`` (default True) lets the
    cost model choose per shape among ATen and every packed kernel this build has; False (or no
    cost model) rewrites every eligible linear to ``kernel`` (default ``"mkl"``; ``"onednn"``),
    or none where the build lacks that kernel.
    """
    candidates = kernels(ctx.device)
    if not candidates or ctx.training:
        return PassResult(gm, False)
    measure = bool(ctx.options.get("measure", True)) and ctx.cost is not None
    default = str(ctx.options.get("kernel", KERNELS[0]))
    if default not in KERNELS:
        raise ValueError(f"packed_linear: no kernel {default!r} (known: {KERNELS})")
    if not measure and default not in candidates:
        log.debug("packed_linear: this build has no %s kernel", default)
        return PassResult(gm, False)
    counts = {"linear": 0, **dict.fromkeys(KERNELS, 0), "linear_kept_aten": 0, "packed_mib": 0}
    packed_bytes = 0
    graph = gm.graph
    cold = measure and weights_outgrow_cache(gm)
    chosen = _measure_first(gm, ctx, candidates, cold) if measure else {}
    for node in list(graph.nodes):
        linear = _eligible(gm, node, cold)
        if linear is None:
            continue
        need = _copies(ctx, linear, candidates, measure, chosen) * _bytes(linear.weight)
        if memory.allowance().shortfall(need, "packed_linear's packed weights"):
            counts["kept_for_memory"] = counts.get("kept_for_memory", 0) + 1
            continue
        if measure:
            kernel = _choose(gm, ctx, linear, candidates, chosen)
            if kernel is None:
                counts["linear_kept_aten"] += 1
                continue
        else:
            usable = _usable(linear, candidates)
            if not usable:
                continue
            kernel = linear.kernel(default if default in usable else usable[0])
        with graph.inserting_before(node):
            fused = graph.call_function(kernel, (linear.input, linear.bias))
        fused.meta = dict(node.meta)
        node.replace_all_uses_with(fused)
        graph.erase_node(node)
        counts["linear"] += 1
        counts[kernel.kernel] += 1
        if kernel.kernel not in OWN_GEMV or linear.derived:  # else the model's weight itself
            packed_bytes += _bytes(linear.weight)
    counts["packed_mib"] = round(packed_bytes / 2**20)
    counts = {k: v for k, v in counts.items() if v}
    if "linear" in counts:
        gm.recompile()
    return PassResult(gm, "linear" in counts, counts)


def _measure_first(gm: GraphModule, ctx: PassContext, candidates: tuple[str, ...],
                   cold: bool) -> dict[str, str]:
    """Measure each distinct linear shape's kernels before any weight is packed, so that the
    candidates' copies (and a cold measurement's eviction buffer) are never alive next to
    every packed copy of the graph (a decoder's 32000-row output projection, measured last:
    +0.13 GiB on the peak of a 58 M-parameter model); the packing that follows reads the
    choices and packs each winner once more. Returns the choices, by ``_what``."""
    chosen: dict[str, str] = {}
    for node in list(gm.graph.nodes):
        # A merged weight's shape alone first: concatenating it is a copy (2.4 GiB over a
        # 1 B decoder's layers), needed only to measure a shape not measured yet.
        linear = _eligible(gm, node, cold, lazy=True)
        if linear is None or _copies(ctx, linear, candidates, True, chosen) <= 1:
            continue  # not a linear, or its choice is known
        if linear.weight.is_meta:
            linear = _eligible(gm, node, cold)
            if linear is None:
                continue
        copies = _rotation(linear)  # a cold measurement's copies; the aten candidate's too
        need = (len(_usable(linear, candidates)) + (copies > 1)) * copies * _bytes(linear.weight)
        if not memory.allowance().shortfall(need, "packed_linear's packed weights"):
            _choose(gm, ctx, linear, candidates, chosen)
    return chosen


def _eligible(gm: GraphModule, node: Node, cold: bool = False,
              lazy: bool = False) -> _Linear | None:
    """The linear's parts, if a packed GEMM computes exactly what the node does: an fp32 (or
    bf16) input whose row sizes are static or symbolic with a traced value (``dynamic``) and
    whose width is static, a constant 2-D weight of its dtype, a constant bias of the output's
    width (or none) and dtype, and for ``addmm`` no scaling (``beta = alpha = 1``)."""
    # ATen level: a lowering pass, run on export graphs, reading ATen's argument names.
    if node.op != "call_function" or node.target not in (ops.LINEAR | ops.ADDMM | ops.MM).aten:
        return None
    kw = call_kwargs(node)
    if kw is None:
        return None
    if node.target in ops.LINEAR.aten:
        x, bias = kw.get("input"), kw.get("bias")
        weight, derived, source = _constant_weight(gm, kw.get("weight"), lazy)
    else:
        if kw.get("beta", 1) != 1 or kw.get("alpha", 1) != 1:
            return None
        if node.target in ops.ADDMM.aten:  # addmm(bias, x, W)
            x, bias = kw.get("mat1"), kw.get("input")
        else:  # mm(x, W)
            x, bias = kw.get("input"), None
        rhs = constant_tensor(gm, kw.get("mat2"))
        weight = rhs.t() if rhs is not None else None  # a view: F.linear's layout, no copy
        derived, source = rhs is not None and is_read_only(rhs), None
    value = meta_val(x)
    shape = size_hints(value)
    if (weight is None or weight.dim() != 2 or weight.dtype not in DTYPES
            or weight.is_mkldnn or shape is None
            or value.dtype != weight.dtype or value.dim() < 1 or value.device.type != "cpu"
            or not is_concrete_int(value.shape[-1]) or shape[-1] != weight.shape[1]):
        return None
    if bias is not None:
        b = constant_tensor(gm, bias)
        if b is None or b.dtype != weight.dtype or tuple(b.shape) != (weight.shape[0],):
            return None
    rows = math.prod(shape[:-1])
    if rows == 0:
        return None
    dynamic = has_symbolic_size(value)
    return _Linear(node, x, weight.detach(), bias, rows, derived, cold and rows <= _COLD_ROWS,
                   source, dynamic, shape)


def _constant_weight(gm: GraphModule, node: Any, lazy: bool = False,
                     ) -> tuple[torch.Tensor | None, bool, Callable[[], torch.Tensor] | None]:
    """A linear's constant weight, whether a pass made it (not the model's own) and, for a
    merged one, what concatenates it again: a ``get_attr`` constant, or a merged weight the
    driver reads as a concatenation of the model's weights (``merge_linear.CONCATENATED``),
    computed here to be packed (``lazy``: only its shape, a meta tensor)."""
    weight = constant_tensor(gm, node)
    if weight is not None:
        return weight, is_read_only(weight), None
    if isinstance(node, Node) and node.meta.get(CONCATENATED) and node.target is aten.cat.default:
        parts = [constant_tensor(gm, p) for p in node.args[0]]
        if parts and all(p is not None for p in parts):
            if lazy:
                return torch.cat([p.detach().to("meta") for p in parts]), True, None
            # The model's weights: holding them is free.
            source = Concatenation([p.detach() for p in parts])
            return source(), True, source
    return None, False, None


def _what(linear: _Linear, bias: bool) -> str:
    """The cost model's name for this linear's kernel choice."""
    return (f"linear|{linear.shape}|{tuple(linear.weight.shape)}|{linear.weight.dtype}|bias={bias}"
            + ("|cold" if linear.cold else "") + ("|dynamic" if linear.dynamic else ""))


def _usable(linear: _Linear, candidates: tuple[str, ...]) -> tuple[str, ...]:
    """The kernels that serve this linear at every row count it may see and in its dtype: MKL's
    packed GEMM runs only at the row count it packed for (``aten.linear`` at any other), so a
    symbolic count leaves oneDNN, whose blocked weight serves any; MKL's is fp32 only."""
    return tuple(k for k in candidates if k in kernels_for(linear.weight.dtype)
                 and not ((k == "mkl" or k in OWN_GEMV) and linear.dynamic)
                 and not (k == "fbgemm_fp16" and not linear.fits_fp16)
                 and not (k in OWN_GEMV and not linear.fits_rows_kernel))


def _copies(ctx: PassContext, linear: _Linear, candidates: tuple[str, ...],
            measure: bool, chosen: dict[str, str]) -> int:
    """How many copies of the weight packing this linear holds at once: one per candidate
    kernel while a shape is measured, one where its choice is cached (none where that is
    ATen) or not measured."""
    if not measure:
        return 1
    candidates = _usable(linear, candidates)
    what = _what(linear, linear.bias is not None)
    if what in chosen:
        return int(chosen[what] != "aten")
    names = [f"{k}_packed" for k in candidates] + ["aten"]
    stored = ctx.cost.recorded(what, names)
    if stored:
        return int(min(stored, key=stored.__getitem__) != "aten")
    return len(candidates)


def against_fp32(gm: GraphModule, ctx: PassContext, node: Node, name: str,
                 make: Callable[[torch.Tensor, torch.Tensor | None], Callable[[torch.Tensor], Any]],
                 weight_share: float, measured: dict[str, tuple[str, dict[str, float]]],
                 cold: bool, more: Mapping[str, Callable[..., Any]] | None = None,
                 ) -> tuple[str, dict[str, float]] | None:
    """Time another kernel for a linear (``name``: an int8 one) against every fp32 kernel this
    pass chooses among (ATen's and each packed one), the way this pass times its own: on a
    random input of the real shape, from memory where the model's weights outgrow the cache.

    Args:
        node: the linear (``linear``, ``addmm`` or ``mm`` on a constant weight).
        make: ``make(weight, bias)`` -> the other kernel on a copy of that ``(out, in)``
            weight, called with the input.
        weight_share: the other kernel's weight bytes over fp32's (for the memory its copies
            take while measured).
        measured: this pass's results by shape, filled here: each shape is timed once.
        cold: ``weights_outgrow_cache(gm)``, found once for all the graph's linears.
        more: other kernels timed with ``name``'s, by name, each made as ``make`` is (int8's
            weight-only kernel beside the dynamic one).
    Returns:
        The fastest kernel's name and every kernel's seconds; None where the node is not a
        linear this pass could pack, or its copies would not fit the memory optimize may add.
    """
    candidates = kernels(ctx.device)
    linear = _eligible(gm, node, cold)
    if linear is None or ctx.cost is None or linear.weight.dtype != torch.float32:
        return None
    candidates = _usable(linear, candidates)
    bias = attr(gm, linear.bias) if linear.bias is not None else None
    what = f"{name}|{_what(linear, bias is not None)}"
    others = dict(more or {})
    names = ["aten", *(f"{k}_packed" for k in candidates), name, *others]
    stored = measured.get(what)
    if stored is None and (seconds := ctx.cost.recorded(what, names)):
        stored = min(names, key=lambda n: (seconds[n], names.index(n))), seconds
    if stored is not None:
        measured[what] = stored
        return stored
    copies = _rotation(linear)
    need = (len(candidates) * copies + copies - 1
            + copies * weight_share * (1 + len(others))) * _bytes(linear.weight)
    if memory.allowance().shortfall(int(need), f"{name}'s measurement against fp32"):
        return None
    x = torch.randn(linear.shape, dtype=torch.float32)
    weights = [linear.weight] + [linear.weight.clone() for _ in range(copies - 1)]
    runs: dict[str, Callable[[], Any]] = {"aten": lambda: [F.linear(x, w, bias) for w in weights]}
    for k in candidates:
        packs = [PackedLinear(w, linear.rows, k, linear.derived) for w in weights]
        runs[f"{k}_packed"] = lambda packs=packs: [p(x, bias) for p in packs]
    # As many calls as each fp32 candidate makes, each on a weight of its own: after the
    # cache is evicted each is read from memory once, as the fp32 copies are (more copies
    # of the smaller weight would time more calls, not a colder one).
    for other, build in {name: make, **others}.items():
        alternates = [build(w, bias) for w in weights]
        runs[other] = lambda alternates=alternates: [f(x) for f in alternates]
    result = ctx.cost.fastest(what, runs, repeats=7 if linear.cold else 3, cold=linear.cold)
    measured[what] = result
    return result


# A linear at r rows does r/2 FLOP per byte of its fp32 weight: up to 16 rows (8 FLOP/B) a CPU
# GEMM is bound by reading the weight (an AMD EPYC core: ~250 GFLOP/s from oneDNN over ~40
# GB/s, about 6 FLOP/B), so where it reads it from decides its speed; above, the weight is
# reused across rows from cache and a cold measurement would only take longer.
_COLD_ROWS = 16


def _bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _rotation(linear: _Linear) -> int:
    """How many copies of the weight a cold measurement sweeps: enough to outgrow the
    last-level cache 1.5 times (at most 128), one where the weight alone does."""
    sweep = 3 * cpu_cache_bytes(last_level=True) // 2
    size = _bytes(linear.weight)
    return 1 if not linear.cold or size >= sweep else min(128, -(-sweep // size))


def weights_outgrow_cache(gm: GraphModule) -> bool:
    """Whether the linears' weights together are larger than the last-level cache: then each
    call reads its weight from memory, not from cache (a decoder's step reads every weight
    once), and the kernels are measured that way. At one row, from cache, ATen and MKL measure
    as fast as oneDNN; streaming from memory oneDNN's reads ~1.8x faster on an AMD EPYC (36
    against 18-21 GB/s at 1 thread over GPT-2's layers)."""
    total = 0  # from the shapes, not _eligible: that would concatenate merged weights
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target not in (ops.LINEAR | ops.ADDMM | ops.MM).aten:
            continue
        kw = call_kwargs(node) or {}
        x, y = meta_val(kw.get("mat1", kw.get("input"))), meta_val(node)
        if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and x.dim() and y.dim():
            total += int(x.shape[-1]) * int(y.shape[-1]) * y.element_size()
    return total > cpu_cache_bytes(last_level=True)


def _choose(gm: GraphModule, ctx: PassContext, linear: _Linear,
            candidates: tuple[str, ...], chosen: dict[str, str]) -> PackedLinear | None:
    """The packed kernel the cost model measures fastest for this shape, or None where
    ``aten.linear`` is: every packed kernel of ``candidates`` and ATen, on a random input of the
    real shape (ties go to MKL, then oneDNN, then ATen), from memory where ``linear.cold``.
    ``chosen`` holds this pass's choices by shape: one there is packed without measuring, and
    one measured here joins it."""
    bias = attr(gm, linear.bias) if linear.bias is not None else None
    what = _what(linear, bias is not None)
    if what in chosen:
        best = chosen[what]
        return None if best == "aten" else linear.kernel(best.removesuffix("_packed"))
    candidates = _usable(linear, candidates)
    x = torch.randn(linear.shape, dtype=linear.weight.dtype)
    # Cold: each run sweeps copies of the weight that together outgrow the last-level cache,
    # as a decoder's step streams its layers (a single call after evicting the cache measured
    # ATen ahead at 768x768, one row; in the model and in a sweep oneDNN ran 1.2-1.4x faster).
    # clone() keeps the layout (a Conv1D weight's transposed view stays transposed).
    weights = [linear.weight] + [linear.weight.clone() for _ in range(_rotation(linear) - 1)]
    # Packed copies are made as a candidate is first run: where this shape's choice is cached
    # (a decoder's repeated layers) only the winner is packed, and the losers' copies are
    # dropped on return.
    packed = {f"{k}_packed": functools.cache(
        lambda k=k: [linear.kernel(k)] + [PackedLinear(w, linear.rows, k, linear.derived)
                                          for w in weights[1:]])
        for k in candidates}
    runs: dict[str, Any] = {name: (lambda make=make: [p(x, bias) for p in make()])
                            for name, make in packed.items()}
    runs["aten"] = lambda: [F.linear(x, w, bias) for w in weights]
    # Cold runs are short and noisier (a memory-bound kernel shares the machine's bandwidth):
    # more rounds.
    best, seconds = ctx.cost.fastest(what, runs, repeats=7 if linear.cold else 3,
                                     cold=linear.cold)
    log.debug("%s: %s -> %s", what, seconds, best)
    chosen[what] = best
    return packed[best]()[0] if best in packed else None
