"""Which ops of a graph static int8 errs at: each one quantized alone, the rest fp32.

Static int8 is applied by the engines' own quantizers (NNCF, ONNX Runtime's), whole graph at
a time; when none of them stays within the tolerance, the refusal names the ops to blame.
This is how: activation ranges are observed on the calibration batches (min and max of each
convolution's and matrix multiply's inputs), then, for each such op alone, its activations
are quantized per tensor (asymmetric, uint8, as both quantizers do on x86) and its weight
per output channel (symmetric int8), and the model's output compared with fp32's. Only the
refusal runs it: one forward per op.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch.fx import GraphModule, Interpreter, Node
from torch.utils import _pytree as pytree

aten = torch.ops.aten

# Each op static int8 quantizes: which of its arguments is a weight, and its output-channel
# dimension (the others are activations).
QUANTIZED: dict[Any, dict[int, int]] = {
    aten.convolution.default: {1: 0},
    aten.linear.default: {1: 0},
    aten.addmm.default: {2: 1},
    aten.mm.default: {},
    aten.bmm.default: {},
    aten.matmul.default: {},
    # Its two matrix multiplies (the engines quantize both, the probabilities too).
    aten.scaled_dot_product_attention.default: {},
}


def quantized_ops(gm: GraphModule) -> list[Node]:
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target in QUANTIZED]


def observe(gm: GraphModule, batches: Iterable[Sequence[Any]]) -> dict[tuple[str, int],
                                                                        tuple[float, float]]:
    """The range of each quantized op's activation inputs over ``batches`` (each the graph's
    positional inputs), by ``(node name, argument index)``; always holding 0, as an
    asymmetric uint8 range does."""
    seen: dict[tuple[str, int], tuple[float, float]] = {}

    def look(node: Node, args: tuple[Any, ...]) -> None:
        for i, value in _activations(node, args):
            lo, hi = float(value.min()), float(value.max())
            old = seen.get((node.name, i), (0.0, 0.0))
            seen[(node.name, i)] = (min(old[0], lo), max(old[1], hi))

    with torch.no_grad():
        for inputs in batches:
            _Run(gm, look).run(*inputs)
    return seen


def errors(gm: GraphModule, ranges: dict[tuple[str, int], tuple[float, float]],
           sets: Sequence[Sequence[Any]], names: Sequence[str] | None = None,
           ) -> dict[str, float]:
    """Each quantized op's error alone: the largest output difference from fp32's over
    ``max(1, max|output|)`` (verification's measure), with only that op in int8, over the
    input ``sets`` (each the graph's positional inputs)."""
    found: dict[str, float] = {}
    with torch.no_grad():
        for inputs in sets:
            reference = _floats(_Run(gm).run(*inputs))
            for node in quantized_ops(gm):
                if names is not None and node.name not in names:
                    continue
                out = _floats(_Run(gm, quantize={node.name: ranges}).run(*inputs))
                found[node.name] = max(found.get(node.name, 0.0), max(
                    (float((a - b).abs().max()) / max(1.0, float(b.abs().max()))
                     for a, b in zip(out, reference, strict=True) if b.numel()), default=0.0))
    return found


def blamed(found: dict[str, float], tolerance: float, most: int = 5) -> list[tuple[str, float]]:
    """The ops to name: those erring beyond ``tolerance`` alone, worst first; where none does
    alone (the error adds up), the worst few."""
    worst = sorted(found.items(), key=lambda kv: -kv[1])
    over = [kv for kv in worst if kv[1] > tolerance]
    return (over or worst)[:most]


class _Run(Interpreter):
    """Runs the graph, showing each quantized op's arguments to ``look``, or with the ops in
    ``quantize`` fed int8-rounded arguments."""

    def __init__(self, gm: GraphModule, look: Callable[[Node, tuple[Any, ...]], None] | None
                 = None, quantize: dict[str, dict[tuple[str, int], tuple[float, float]]]
                 | None = None) -> None:
        super().__init__(gm)
        self._look = look
        self._quantize = quantize or {}

    def run_node(self, n: Node) -> Any:
        self._node = n
        return super().run_node(n)

    def call_function(self, target: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        node = self._node
        if target in QUANTIZED:
            if self._look is not None:
                self._look(node, args)
            if node.name in self._quantize:
                args = _rounded(node, args, self._quantize[node.name])
                if target is aten.scaled_dot_product_attention.default:
                    return _attention(*args, **kwargs)
        return super().call_function(target, args, kwargs)


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0,
               is_causal: bool = False, scale: float | None = None,
               enable_gqa: bool = False) -> torch.Tensor:
    """Attention with its probabilities rounded to uint8 steps of 1/255, as a quantized
    second matrix multiply reads them (``q, k, v`` already rounded)."""
    if enable_gqa and k.shape[-3] != q.shape[-3]:
        repeat = q.shape[-3] // k.shape[-3]
        k, v = k.repeat_interleave(repeat, -3), v.repeat_interleave(repeat, -3)
    scores = q @ k.transpose(-2, -1) * (scale if scale is not None else q.shape[-1] ** -0.5)
    if is_causal:
        causal = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool).tril()
        scores = scores.masked_fill(~causal, float("-inf"))
    if attn_mask is not None:
        scores = scores.masked_fill(~attn_mask, float("-inf")) \
            if attn_mask.dtype == torch.bool else scores + attn_mask
    probabilities = torch.round(torch.softmax(scores, -1) * 255) / 255
    return probabilities @ v


def _activations(node: Node, args: tuple[Any, ...]) -> list[tuple[int, torch.Tensor]]:
    weights = QUANTIZED[node.target]
    if node.target is aten.scaled_dot_product_attention.default:
        args = args[:3]  # q, k, v: not the mask
    return [(i, a) for i, a in enumerate(args) if i not in weights
            and isinstance(a, torch.Tensor) and a.is_floating_point() and a.numel()
            and not (i == 0 and node.target is aten.addmm.default)]  # addmm's bias


def _rounded(node: Node, args: tuple[Any, ...],
             ranges: dict[tuple[str, int], tuple[float, float]]) -> tuple[Any, ...]:
    out = list(args)
    for i, value in _activations(node, args):
        lo, hi = ranges.get((node.name, i), (float(value.min()), float(value.max())))
        lo, hi = min(lo, 0.0), max(hi, 0.0)
        scale = max(hi - lo, 1e-12) / 255.0
        zero = round(-lo / scale)
        q = torch.clamp(torch.round(value / scale) + zero, 0, 255)
        out[i] = (q - zero) * scale
    for i, dim in QUANTIZED[node.target].items():
        w = args[i] if i < len(args) else None
        if isinstance(w, torch.Tensor) and w.is_floating_point():
            reduce = [d for d in range(w.dim()) if d != dim]
            scale = w.abs().amax(dim=reduce, keepdim=True).clamp_min(1e-12) / 127.0
            out[i] = torch.clamp(torch.round(w / scale), -127, 127) * scale
    return tuple(out)


def _floats(value: Any) -> list[torch.Tensor]:
    return [x.detach().float() for x in pytree.tree_leaves(value)
            if isinstance(x, torch.Tensor) and x.is_floating_point()]
