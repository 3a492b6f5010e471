"""Linear layers onto MKL's packed GEMM, with each weight packed once (CPU inference).

    x ─ linear(W, b) ─ y         ⟶   x ─ mkl_linear(W', b) ─ y
    x ─ addmm(b, x, Wᵀ) ─ y      ⟶   x ─ mkl_linear(W', b) ─ y     (GPT-2's Conv1D)
    x ─ mm(x, Wᵀ) ─ y            ⟶   x ─ mkl_linear(W', None) ─ y

``W'`` is ``W`` in MKL's packed GEMM layout (``cblas_sgemm_pack``) for this many rows of
``x``. Eager ``aten.linear`` runs the same MKL GEMM but repacks panels of ``W`` on every call;
with the packing done once, BERT's and ViT's linear shapes measured 5–10% faster at 1024 rows
and 20–28% at 128 (1 thread) on a Sapphire Rapids, with outputs equal to ``aten.linear``'s
within fp32 rounding (same kernel; bitwise equal there, one ulp apart on an AMD EPYC at 2
threads, where MKL splits the reduction differently). The price is memory: the packed copy
is about the weight's size, held next to the original (which the graph shares with the user's
model); the pass reports it as ``packed_mib``. Where a cost model is present, each distinct
shape keeps whichever kernel it measures faster on this machine.

fp32 only (MKL's sgemm), on a CPU build with MKL, not in training (the packed copy is a
constant that gradients would not reach). It is a lowering: exports take the graph from before
it (``autoopt.passes.LOWERING``).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensor
from torch.fx import GraphModule, Node

from . import ops
from .base import PassContext, PassResult
from .graph import attr, call_kwargs, constant_tensor, meta_val

log = logging.getLogger(__name__)

aten = torch.ops.aten


class PackedLinear:
    """One linear's MKL call with its packed weight bound: the graph calls this object.

    ``weight`` is in ``F.linear``'s layout ``(out, in)``, possibly a transposed view of the
    model's own tensor (no copy). Packed weights are opaque (no storage) and derived from the
    model's weights, so a deep copy of the graph shares them. On meta or fake tensors (shape
    propagation, FLOP counting) it computes the same thing with ``F.linear``.
    """

    def __init__(self, weight: torch.Tensor, rows: int) -> None:
        self.__name__ = "mkl_linear"  # what FX prints and names the call's global
        self.weight, self.rows = weight, rows
        self.packed = self._pack()
        self.threads = torch.get_num_threads()  # what the packing and the choice were made for
        # The cost model keys measurements by op name and argument shapes; the weight is bound
        # here, not an argument, so the name carries its shape ("linear" names the family).
        self.__qualname__ = f"linear[{'x'.join(map(str, weight.shape))},m{rows}]"

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if x.device.type == "meta" or isinstance(x, FakeTensor):
            return F.linear(x, x.new_empty(self.weight.shape), bias)
        threads = torch.get_num_threads()
        if threads != self.threads:
            # MKL packs for the thread count of the moment: a weight packed at 1 thread runs on
            # 1 thread only (measured: 2x slower at 2 threads than one packed at 2), so the
            # weight is packed again for the new count, once.
            self.packed, self.threads = self._pack(), threads
        # MKL checks the row count itself: at another count it runs aten.linear on ``weight``.
        return torch.ops.mkl._mkl_linear(x, self.packed, self.weight, bias, self.rows)

    def _pack(self) -> torch.Tensor:
        return torch.ops.mkl._mkl_reorder_linear_weight(self.weight.contiguous(), self.rows)

    def reference(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """The same function in ATen, on the unpacked weight."""
        return F.linear(x, self.weight, bias)

    def __deepcopy__(self, memo: dict[int, Any]) -> PackedLinear:
        return self

    def __repr__(self) -> str:
        return f"mkl_linear(weight={tuple(self.weight.shape)}, rows={self.rows})"


@dataclass(frozen=True)
class _Linear:
    node: Node
    input: Node
    weight: torch.Tensor  # (out, in), as F.linear takes it
    bias: Node | None
    rows: int


def available(device: torch.device) -> bool:
    """MKL's packed linear exists in this PyTorch build and the target is the CPU."""
    return (device.type == "cpu" and torch.backends.mkl.is_available()
            and hasattr(torch.ops.mkl, "_mkl_linear"))


def packed_linear(gm: GraphModule, ctx: PassContext) -> PassResult:
    """Rewrite fp32 linear layers with constant weights (``linear``, and ``addmm``/``mm`` on a
    constant right-hand matrix) to MKL's GEMM on a weight packed once, where the cost model
    measures it faster.

    Options (``pass_options={"packed_linear": {...}}``): ``measure`` (default True) lets the
    cost model choose per shape; False rewrites every eligible linear.
    """
    if not available(ctx.device) or ctx.training:
        return PassResult(gm, False)
    measure = bool(ctx.options.get("measure", True)) and ctx.cost is not None
    counts = {"linear": 0, "linear_kept_aten": 0, "packed_mib": 0}
    packed_bytes = 0
    graph = gm.graph
    for node in list(graph.nodes):
        linear = _eligible(gm, node)
        if linear is None:
            continue
        kernel = PackedLinear(linear.weight, linear.rows)
        if measure and not _pays(gm, ctx, linear, kernel):
            counts["linear_kept_aten"] += 1
            continue
        with graph.inserting_before(node):
            fused = graph.call_function(kernel, (linear.input, linear.bias))
        fused.meta = dict(node.meta)
        node.replace_all_uses_with(fused)
        graph.erase_node(node)
        counts["linear"] += 1
        packed_bytes += linear.weight.numel() * linear.weight.element_size()
    counts["packed_mib"] = round(packed_bytes / 2**20)
    counts = {k: v for k, v in counts.items() if v}
    if "linear" in counts:
        gm.recompile()
    return PassResult(gm, "linear" in counts, counts)


def _eligible(gm: GraphModule, node: Node) -> _Linear | None:
    """The linear's parts, if MKL's packed GEMM computes exactly what the node does: an fp32
    input of static shape, a constant 2-D fp32 weight, a constant bias of the output's width
    (or none), and for ``addmm`` no scaling (``beta = alpha = 1``)."""
    # ATen level: a lowering pass, run on export graphs, reading ATen's argument names.
    if node.op != "call_function" or node.target not in (ops.LINEAR | ops.ADDMM | ops.MM).aten:
        return None
    kw = call_kwargs(node)
    if kw is None:
        return None
    if node.target in ops.LINEAR.aten:
        x, weight, bias = kw.get("input"), constant_tensor(gm, kw.get("weight")), kw.get("bias")
    else:
        if kw.get("beta", 1) != 1 or kw.get("alpha", 1) != 1:
            return None
        if node.target in ops.ADDMM.aten:  # addmm(bias, x, W)
            x, bias = kw.get("mat1"), kw.get("input")
        else:  # mm(x, W)
            x, bias = kw.get("input"), None
        rhs = constant_tensor(gm, kw.get("mat2"))
        weight = rhs.t() if rhs is not None else None  # a view: F.linear's layout, no copy
    value = meta_val(x)
    if (weight is None or weight.dim() != 2 or weight.dtype != torch.float32
            or weight.is_mkldnn
            or not isinstance(value, torch.Tensor) or value.dtype != torch.float32
            or value.dim() < 1 or value.device.type != "cpu"
            or not all(isinstance(s, int) for s in value.shape)
            or value.shape[-1] != weight.shape[1]):
        return None
    if bias is not None:
        b = constant_tensor(gm, bias)
        if b is None or b.dtype != torch.float32 or tuple(b.shape) != (weight.shape[0],):
            return None
    rows = math.prod(value.shape[:-1])
    if rows == 0:
        return None
    return _Linear(node, x, weight.detach(), bias, rows)


def _pays(gm: GraphModule, ctx: PassContext, linear: _Linear, kernel: PackedLinear) -> bool:
    """Whether the cost model measures the packed GEMM at least as fast as ``aten.linear``, on
    a random input of the real shape."""
    value = meta_val(linear.input)
    x = torch.randn(value.shape, dtype=value.dtype)
    bias = attr(gm, linear.bias) if linear.bias is not None else None
    what = (f"linear|{tuple(x.shape)}|{tuple(linear.weight.shape)}|{x.dtype}|"
            f"bias={bias is not None}")
    best, seconds = ctx.cost.fastest(what, {"mkl_packed": lambda: kernel(x, bias),
                                            "aten": lambda: kernel.reference(x, bias)})
    log.debug("%s: %s", what, seconds)
    return best == "mkl_packed"
