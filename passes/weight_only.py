"""Weight-only int8 and int4 linears for CPU inference, and the next-token agreement that judges
a quantized decoder.

    x ─ linear(W, b) ─ y   ⟶   x ─ bf16 ─ _weight_int8pack_mm(q8, s) ─ fp32 ─ (+ b) ─ y
    x ─ linear(W, b) ─ y   ⟶   x ─ bf16 ─ _weight_int4pack_mm_for_cpu(pack(q4), g, s|z) ─ fp32
                                                                                ─ (+ b) ─ y

Only the weight is quantized; activations stay floating point, so no calibration data is
needed and nothing is computed per call but the product:

- int8: symmetric, one scale per output channel (a row's largest magnitude maps to 127);
- int4: asymmetric, one scale and one zero per group of ``group`` consecutive input features
  of a row (GGUF's Q4 and torchao's int4 weight-only use groups of 32 to 128):
  ``w ≈ (q - 8) * scale + zero`` with ``q`` in 0..15.

The kernels are ATen's (``torch.ops.aten._weight_int8pack_mm``,
``_weight_int4pack_mm_for_cpu``); autoopt's own (``block_kernels``: the same codes with int8
activations per block, VNNI dot products) are the other candidates for the same weights.
ATen's read the packed weight once and dequantize in registers, but only with bf16
activations: with fp32 ones they take a scalar path (measured on an AVX-512 Xeon, 768 x 768
at one row, 1 thread: int8 1.4 ms in fp32 against 0.10 ms in bf16, int4 2.4 ms against 0.09
ms; fp32's own linear 0.18 ms). So the input is rounded to bf16 and the product returned in
fp32: one bf16 rounding of each (relative 2^-9), well under the
weights' own rounding. Scales and zeros are stored in bf16 too, and the dequantized reference
(``dequantize_int8``/``dequantize_int4``) uses the same rounded values.

ATen's int8 kernel crashes the process (segmentation fault, torch 2.14) where the input width
is not a multiple of 16: such linears are not candidates (``int8_weight_fits``). Its int4
packing needs an output width that is a multiple of 16: other weights are packed with zero
rows up to one and the product sliced back (GPT-2's 50257-wide output head, a third of its
weights, had stayed fp32 and int4 decoded at 2.0x eager where the Llama-style model's ran at
3.3x).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.fx import GraphModule, Node

from .graph import meta_val

aten = torch.ops.aten

# The group size int4 uses where the option does not say (Q4_0's); 64 and 128 are the others
# the formats use. Smaller groups follow the weights more closely.
DEFAULT_GROUP = 32
GROUPS = (32, 64, 128)
# The int4 packing works on tiles of 16 output channels; the int8 kernel on 16 input features.
_INT4_OUT_MULTIPLE = 16
_INT8_IN_MULTIPLE = 16


@dataclass(frozen=True)
class Int8Weight:
    """An ``(out, in)`` weight in int8 with one bf16 scale per output channel."""

    q: torch.Tensor  # int8, (out, in)
    scales: torch.Tensor  # bf16, (out,)


@dataclass(frozen=True)
class Int4Weight:
    """An ``(out, in)`` weight in int4, packed for ``_weight_int4pack_mm_for_cpu``."""

    packed: torch.Tensor  # uint8, (padded out, in / 2)
    group: int
    scale_zeros: torch.Tensor  # bf16, (in / group, padded out, 2): scale and zero per group
    out: int  # the output width: the kernel's product has ``padded out`` columns, sliced


def int8_weight_fits(weight: torch.Tensor) -> bool:
    return weight.dim() == 2 and weight.shape[1] % _INT8_IN_MULTIPLE == 0


def int4_fits(weight: torch.Tensor, group: int) -> bool:
    return weight.dim() == 2 and weight.shape[1] % group == 0


def widths_needed(kernel: str, group: int = DEFAULT_GROUP) -> str:
    """What a linear's widths must be for ``kernel`` (``int8_weight`` or ``int4``), in words."""
    if kernel == "int4":
        return f"an input width that is a multiple of the group size {group}"
    return f"an input width that is a multiple of {_INT8_IN_MULTIPLE}"


def quantize_int8(weight: torch.Tensor) -> Int8Weight:
    """Symmetric per-output-channel int8 of an fp32 ``(out, in)`` weight."""
    w = weight.detach().float()
    scales = (w.abs().amax(dim=1).clamp_min(1e-12) / 127.0).to(torch.bfloat16)
    q = torch.round(w / scales.float()[:, None]).clamp(-128, 127).to(torch.int8)
    return Int8Weight(q.contiguous(), scales)


def dequantize_int8(packed: Int8Weight) -> torch.Tensor:
    return packed.q.float() * packed.scales.float()[:, None]


def _int4_codes(weight: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The 0..15 codes ``(out, in)`` int32 and the bf16 ``(in / group, out, 2)`` scales and
    zeros of an fp32 weight: each group's range split in 15 steps."""
    out, width = weight.shape
    w = weight.detach().float().reshape(out, width // group, group)
    low, high = w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
    scale = ((high - low).clamp_min(1e-12) / 15).to(torch.bfloat16).float()
    zero = (low + 8 * scale).to(torch.bfloat16).float()
    # From the rounded scale and zero, so that codes and their dequantization agree.
    codes = torch.round((w - zero) / scale + 8).clamp(0, 15).to(torch.int32)
    scale_zeros = torch.stack([scale.squeeze(-1), zero.squeeze(-1)], dim=-1)  # (out, g, 2)
    return codes.reshape(out, width), scale_zeros.transpose(0, 1).contiguous().to(
        torch.bfloat16)


def quantize_int4(weight: torch.Tensor, group: int = DEFAULT_GROUP) -> Int4Weight:
    """Asymmetric int4 of an fp32 ``(out, in)`` weight in groups of ``group`` input features."""
    if not int4_fits(weight, group):
        raise ValueError(f"int4 needs an input width that is a multiple of the group size "
                         f"{group}; got a weight of {tuple(weight.shape)}")
    codes, scale_zeros = _int4_codes(weight, group)
    out = codes.shape[0]
    pad = -out % _INT4_OUT_MULTIPLE
    if pad:  # zero rows (code 8 at scale and zero 0): the kernel's extra columns, sliced off
        codes = torch.cat([codes, codes.new_full((pad, codes.shape[1]), 8)])
        scale_zeros = torch.cat([scale_zeros, scale_zeros.new_zeros(
            (scale_zeros.shape[0], pad, 2))], dim=1)
    packed = aten._convert_weight_to_int4pack_for_cpu(codes, 1)
    return Int4Weight(packed, group, scale_zeros, out)


def dequantize_int4(weight: torch.Tensor, group: int = DEFAULT_GROUP) -> torch.Tensor:
    """What ``quantize_int4(weight, group)`` stores, back in fp32: the reference its kernel
    computes with (up to bf16 activations and output)."""
    codes, scale_zeros = _int4_codes(weight, group)
    out, width = codes.shape
    sz = scale_zeros.float().transpose(0, 1)  # (out, g, 2)
    grouped = codes.float().reshape(out, width // group, group)
    return ((grouped - 8) * sz[..., :1] + sz[..., 1:]).reshape(out, width)


def linear(x: torch.Tensor, weight: Int8Weight | Int4Weight,
           bias: torch.Tensor | None) -> torch.Tensor:
    """The weight-only linear, run eagerly: what ``emit`` writes into a graph."""
    rows = _kernel_rows(x)
    if isinstance(weight, Int8Weight):
        y = aten._weight_int8pack_mm(rows, weight.q, weight.scales)
    else:
        y = aten._weight_int4pack_mm_for_cpu(rows, weight.packed, weight.group,
                                             weight.scale_zeros)[:, :weight.out]
    y = y.to(x.dtype).reshape(*x.shape[:-1], y.shape[-1])
    return y if bias is None else y + bias


def _kernel_rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` as the kernels read it: bf16 rows, contiguous, from an aligned address.

    ATen's int8 kernel reads rows ``in`` elements apart from the first one's address with
    aligned 32-byte loads, and checks only the last dimension's stride: a bf16 input that is a
    view (a slice of a wider tensor, at an offset) reads the wrong rows or faults the process.
    """
    rows = x.reshape(-1, x.shape[-1]).to(torch.bfloat16)
    if not rows.is_contiguous() or rows.data_ptr() % _ALIGNMENT:
        rows = rows.clone(memory_format=torch.contiguous_format)
    return rows


# The CPU allocator's alignment, which the kernels' aligned loads need (32 bytes for bf16 rows).
_ALIGNMENT = 64


def tensors(weight: Int8Weight | Int4Weight) -> dict[str, torch.Tensor]:
    """The tensors a graph holds for ``weight``, by a suffix for their attribute names."""
    if isinstance(weight, Int8Weight):
        return {"q": weight.q, "scales": weight.scales}
    return {"packed": weight.packed, "scale_zeros": weight.scale_zeros}


def weight_bytes(weight: Int8Weight | Int4Weight) -> int:
    return sum(t.numel() * t.element_size() for t in tensors(weight).values())


def emit(gm: GraphModule, node: Node, x: Node, weight: Int8Weight | Int4Weight,
         attrs: dict[str, Node], bias: Node | None) -> Node:
    """The weight-only linear's nodes before ``node`` (whose input is ``x``), reading the
    weight's tensors from the ``get_attr`` nodes ``attrs`` (``tensors(weight)``'s keys); the
    last node gives the result."""
    graph = gm.graph
    x_val, y_val = meta_val(x), meta_val(node)
    width, out = x_val.shape[-1], y_val.shape[-1]
    flat = x_val.dim() != 2
    rows = _call(graph, aten.reshape.default, (x, [-1, width]), x_val.reshape(-1, width)) \
        if flat else x
    rows_val = meta_val(rows)
    # A copy always (the input may be bf16 already): a new contiguous allocation is aligned,
    # as the int8 kernel's loads need (see _kernel_rows).
    low = _call(graph, aten._to_copy.default, (rows,),
                rows_val.to(torch.bfloat16, memory_format=torch.contiguous_format),
                {"dtype": torch.bfloat16, "memory_format": torch.contiguous_format})
    y_flat_val = y_val.reshape(-1, out)
    if isinstance(weight, Int8Weight):
        y = _call(graph, aten._weight_int8pack_mm.default,
                  (low, attrs["q"], attrs["scales"]), y_flat_val.to(torch.bfloat16))
    else:
        padded = weight.scale_zeros.shape[1]
        y = _call(graph, aten._weight_int4pack_mm_for_cpu.default,
                  (low, attrs["packed"], weight.group, attrs["scale_zeros"]),
                  y_flat_val.new_empty((y_flat_val.shape[0], padded), dtype=torch.bfloat16))
        if padded != out:
            y = _call(graph, aten.slice.Tensor, (y, 1, 0, out), y_flat_val.to(torch.bfloat16))
    y = _call(graph, aten._to_copy.default, (y,), y_flat_val, {"dtype": y_val.dtype})
    if flat:
        y = _call(graph, aten.reshape.default, (y, _sizes(graph, x, x_val.shape[:-1]) + [out]),
                  y_val)
    return y if bias is None else _call(graph, aten.add.Tensor, (y, bias), y_val)


def _sizes(graph: Any, x: Node, shape: Sequence[Any]) -> list[Any]:
    """``shape`` as reshape's sizes: ints as they are, a symbolic size read from ``x``."""
    sizes: list[Any] = []
    for i, size in enumerate(shape):
        if isinstance(size, int):
            sizes.append(size)
        else:
            sizes.append(_call(graph, aten.sym_size.int, (x, i), size))
    return sizes


def _call(graph: Any, target: Any, args: tuple[Any, ...], val: Any,
          kwargs: dict[str, Any] | None = None) -> Node:
    new = graph.call_function(target, args, kwargs or {})
    new.meta["val"] = val
    return new


# --- next-token agreement --------------------------------------------------------------------

# Graph outputs that are logits: a linear's output reaching the graph's output through these
# (a dtype cast, a copy, a reshape keeping the last dimension).
_PASS_THROUGH = frozenset({
    aten._to_copy.default, aten.clone.default, aten.alias.default, aten.view.default,
    aten.reshape.default, aten._unsafe_view.default, aten.slice.Tensor,
})


def logits_outputs(gm: GraphModule, is_linear: Any) -> list[int]:
    """The indices, among the graph's flattened output leaves, of token logits: a floating
    output of at least 3 dimensions (batch, positions, vocabulary) that a linear computes
    (``is_linear(node)``) with the output's last dimension as its width (an LM head)."""
    from torch.utils import _pytree as pytree

    output = next(n for n in gm.graph.nodes if n.op == "output")
    found = []
    for i, leaf in enumerate(pytree.tree_leaves(output.args[0])):
        val = meta_val(leaf) if isinstance(leaf, Node) else None
        if not (isinstance(val, torch.Tensor) and val.is_floating_point() and val.dim() >= 3):
            continue
        node, hops = leaf, 0
        while (node.op == "call_function" and node.target in _PASS_THROUGH and hops < 4
               and isinstance(node.args[0], Node)):
            node, hops = node.args[0], hops + 1
        head = meta_val(node)
        if is_linear(node) and isinstance(head, torch.Tensor) and head.shape[-1:] == \
                val.shape[-1:]:
            found.append(i)
    return found


# A token fp32 scores within this share of its largest |logit| of its best one is a near-tie:
# fp32 itself barely decides between them, and any rounding (another CPU's kernel, a thread
# count) may pick either. Measured on a tiny random GPT-2 (logits up to 0.71): int8 picked
# another token at 1 of 16 positions, with a largest logit error of 0.004.
TIE = 1e-2


@dataclass(frozen=True)
class Agreement:
    """Next-token agreement of a quantized graph with fp32 given the same tokens (teacher
    forcing: each position's logits follow the example's tokens, eager's prefix), and the
    largest logit error.

    Args:
        agreement: the share of positions whose argmax equals fp32's.
        positions: how many positions were compared (batch x sequence over the logits).
        logit_error: the largest ``|logit - fp32 logit|``.
        logit_scale: the largest ``|fp32 logit|``, to read the error against.
        decided: the share of positions whose argmax equals fp32's or is a near-tie in fp32
            (``TIE``): what a precision is judged by.
    """

    agreement: float
    positions: int
    logit_error: float
    logit_scale: float
    decided: float = 1.0


def agreement(expected: Sequence[Any], actual: Sequence[Any],
              indices: Sequence[int]) -> Agreement | None:
    """``Agreement`` over the logits leaves ``indices`` of two runs' flattened outputs; None
    where there are none."""
    same = close = total = 0
    error = scale = 0.0
    for i in indices:
        e, a = expected[i].detach().double(), actual[i].detach().double()
        e2, a2 = e.reshape(-1, e.shape[-1]), a.reshape(-1, a.shape[-1])
        picked = a2.argmax(-1, keepdim=True)
        same += int((e2.argmax(-1, keepdim=True) == picked).sum())
        # How far below fp32's best fp32 scores the token the quantized graph picked.
        gap = e2.amax(-1, keepdim=True) - e2.gather(-1, picked)
        close += int((gap <= TIE * float(e.abs().max())).sum())
        total += e2.shape[0]
        error = max(error, float((a - e).abs().max()))
        scale = max(scale, float(e.abs().max()))
    if not total:
        return None
    return Agreement(same / total, total, error, scale, close / total)
