"""Convolutions onto oneDNN with weights packed once, and the activation or residual add after
them fused into the same kernel (CPU inference).

    x ─ conv2d(W, b) ─ relu ─ y                ⟶   x ─ onednn_conv(W', b, "relu") ─ y
    x ─ conv2d(W, b) ─ add(·, r) ─ relu ─ y    ⟶   x ─ onednn_conv(W', b, r, "add", "relu") ─ y

``W'`` is ``W`` reordered once into oneDNN's blocked layout for this input shape; eager PyTorch
reorders it on every call and writes the activation and the residual sum in separate passes
over memory. Where a cost model is present, each distinct convolution (shapes, stride, groups,
epilogue) keeps whichever kernel the cost model measures faster on this device.

A graph captured with ``dynamic=`` (any batch or image size) is measured and packed at the
sizes it was traced with; the packed weight serves any other size.

The result runs only on a CPU with oneDNN, and packed weights are opaque (no storage; they are
shared, not copied, when the graph is deep-copied). It is a lowering: exports take the graph
from before it (``autoopt.passes.LOWERING``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.fx import GraphModule, Node
from torch.fx.experimental.symbolic_shapes import is_concrete_int, statically_known_true

from . import ops
from .base import PassContext, PassResult
from .graph import attr, call_kwargs, constant_tensor, has_symbolic_size, meta_val, size_hints

log = logging.getLogger(__name__)

aten = torch.ops.aten
# ATen level: a lowering pass, run on export graphs, reading ATen's argument names.
_CONV2D = ops.CONV2D.aten  # `conv2d.padding` (padding="same") has no integer padding: refused
_RESIDUAL_ADD = (ops.ADD | ops.ADD_INPLACE).aten  # a Scalar add has no tensor operand: refused

# Elementwise ops oneDNN applies to the conv's output in registers: op -> (attr, scalars from
# the op's arguments, algorithm). Names are oneDNN's post-op names as torch.ops.mkldnn takes them.
_Epilogue = tuple[str, list[Any], str]
_Geometry = tuple[list[int], list[int], list[int], int]  # padding, stride, dilation, groups


def _fixed(name: str) -> Callable[[dict[str, Any]], _Epilogue]:
    return lambda kw: (name, [], "")


UNARY: dict[Any, Callable[[dict[str, Any]], _Epilogue]] = {
    **dict.fromkeys(ops.RELU.aten, _fixed("relu")),
    **dict.fromkeys(ops.SIGMOID.aten, _fixed("sigmoid")),
    **dict.fromkeys(ops.TANH.aten, _fixed("tanh")),
    **dict.fromkeys(ops.HARDSWISH.aten, _fixed("hardswish")),
    **dict.fromkeys(ops.HARDSIGMOID.aten, _fixed("hardsigmoid")),
    **dict.fromkeys(ops.SILU.aten, _fixed("swish")),
    **dict.fromkeys(ops.HARDTANH.aten, lambda kw: (
        "hardtanh", [float(kw.get("min_val", -1.0)), float(kw.get("max_val", 1.0))], "")),
    **dict.fromkeys(ops.RELU6.aten, lambda kw: ("hardtanh", [0.0, 6.0], "")),
    **dict.fromkeys(ops.LEAKY_RELU.aten, lambda kw: (
        "leaky_relu", [float(kw.get("negative_slope", 0.01))], "")),
    **dict.fromkeys(ops.GELU.aten, lambda kw: (
        "gelu", [], str(kw.get("approximate", "none")))),
}


class PackedConv:
    """One convolution's oneDNN call with its packed weight bound: the graph calls this object.

    Packed weights are opaque (no storage) and derived from the model's weights, so a deep copy
    of the graph shares them. On meta or fake tensors (shape propagation, FLOP counting) it
    computes the same thing with ATen ops on the weight's shape. ``release()`` drops the packed
    copy while another backend is built and measured; ``restore()``, or the next call, packs it
    again for the input shape it was packed for.
    """

    def __init__(self, weight: torch.Tensor, packed: torch.Tensor, geometry: _Geometry,
                 epilogue: _Epilogue | None, add: bool, shape: list[int]) -> None:
        self.__name__ = "onednn_conv2d"  # what FX prints and names the call's global
        self.weight, self.geometry, self.shape = weight, geometry, shape
        self.packed: torch.Tensor | None = packed
        self.epilogue, self.add = epilogue, add
        self.threads = torch.get_num_threads()  # what the packing and the choice were made for
        # The cost model keys measurements by op name and argument shapes; the weight is bound
        # here, not an argument, so the name carries its shape and the conv's geometry.
        padding, stride, dilation, groups = geometry
        self.__qualname__ = (
            f"onednn_conv2d[{'x'.join(map(str, weight.shape))},s{stride},p{padding},"
            f"d{dilation},g{groups},{epilogue[0] if epilogue else 'none'},add={add}]"
        ).replace(" ", "")

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None,
                 other: torch.Tensor | None = None) -> torch.Tensor:
        if x.device.type == "meta" or isinstance(x, FakeTensor):
            return self.reference(x, bias, other, x.new_empty(self.weight.shape))
        threads = torch.get_num_threads()
        if threads != self.threads or self.packed is None:
            # A weight packed for one thread count can run several times slower at another
            # (measured: a dilated resnet50 6x slower packed at 2 threads, run at 1), so the
            # weight is packed again for the new count, once.
            self.shape = list(x.shape)
            self.restore()
        padding, stride, dilation, groups = self.geometry
        name, scalars, algorithm = self.epilogue or ("none", [], "")
        if other is None:
            return torch.ops.mkldnn._convolution_pointwise(
                x, self.packed, bias, padding, stride, dilation, groups, name, scalars,
                algorithm)
        return torch.ops.mkldnn._convolution_pointwise.binary(
            x, other, self.packed, bias, padding, stride, dilation, groups, "add", None,
            name if self.epilogue else None, scalars, algorithm or None)

    def release(self) -> int:
        """Drop the packed copy; the bytes dropped."""
        if self.packed is None:
            return 0
        self.packed = None
        return self.weight.numel() * self.weight.element_size()

    def restore(self) -> None:
        """Pack the weight again, for this thread count."""
        if self.packed is not None and self.threads == torch.get_num_threads():
            return
        self.packed = torch.ops.mkldnn._reorder_convolution_weight(
            self.weight, *self.geometry, self.shape)
        self.threads = torch.get_num_threads()

    def reference(self, x: torch.Tensor, bias: torch.Tensor | None,
                  other: torch.Tensor | None = None, weight: torch.Tensor | None = None,
                  ) -> torch.Tensor:
        """The same function in ATen ops on the unpacked weight."""
        padding, stride, dilation, groups = self.geometry
        weight = self.weight if weight is None else weight
        y = torch.conv2d(x, weight, bias, stride, padding, dilation, groups)
        y = y + other if other is not None else y
        return _reference_unary(self.epilogue)(y) if self.epilogue else y

    def __deepcopy__(self, memo: dict[int, Any]) -> PackedConv:
        return self

    def __repr__(self) -> str:
        epilogue = self.epilogue[0] if self.epilogue else "none"
        return f"onednn_conv2d(weight={tuple(self.weight.shape)}, add={self.add}, " \
               f"epilogue={epilogue})"


@dataclass(frozen=True)
class _Conv:
    node: Node
    input: Node
    weight: torch.Tensor
    bias: Node | None
    padding: list[int]
    stride: list[int]
    dilation: list[int]
    groups: int
    # The input's sizes, each symbolic one (``dynamic=``) as traced: what the weight is packed
    # and measured for; the layout oneDNN picks for them serves any other size (at worst
    # reordered by the kernel).
    shape: list[int]


def available(device: torch.device) -> bool:
    """oneDNN's fused convolution exists in this PyTorch build and the target is the CPU."""
    return (device.type == "cpu" and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_convolution_pointwise"))


def onednn_conv(gm: GraphModule, ctx: PassContext) -> PassResult:
    """Rewrite 2-D convolutions (with a following activation or residual add) to oneDNN's fused
    kernel with prepacked weights, where the cost model measures it faster.

    Options (``pass_options={"onednn_conv": {...}}``): ``measure`` (default True) lets the
    cost model choose per convolution; False rewrites every eligible one.
    """
    if not available(ctx.device) or ctx.training:
        return PassResult(gm, False)
    measure = bool(ctx.options.get("measure", True)) and ctx.cost is not None
    counts = {"conv": 0, "fused_unary": 0, "fused_add": 0, "kept_aten": 0}
    graph = gm.graph
    for node in list(graph.nodes):
        if node.target not in _CONV2D or node.graph is not graph:  # erased as an epilogue
            continue
        conv = _eligible(gm, node)
        if conv is None:
            continue
        add, other, unary = _epilogue(conv.node)
        geometry = (conv.padding, conv.stride, conv.dilation, conv.groups)
        packed = torch.ops.mkldnn._reorder_convolution_weight(conv.weight, *geometry,
                                                             conv.shape)
        kernel = PackedConv(conv.weight, packed, geometry, unary[0][1] if unary else None,
                            add is not None, list(conv.shape))
        if measure and not _pays(gm, ctx, conv, kernel, other):
            counts["kept_aten"] += 1
            continue
        last = unary[0][0] if unary else add or conv.node
        with graph.inserting_before(last):
            args = (conv.input, conv.bias) + ((other,) if other is not None else ())
            fused = graph.call_function(kernel, args)
        fused.meta = dict(last.meta)
        last.replace_all_uses_with(fused)
        for dead in [u for u, _ in unary] + ([add] if add else []) + [conv.node]:
            graph.erase_node(dead)
        counts["conv"] += 1
        counts["fused_unary"] += bool(unary)
        counts["fused_add"] += add is not None
    counts = {k: v for k, v in counts.items() if v}
    if "conv" in counts:
        gm.recompile()
    return PassResult(gm, "conv" in counts, counts)


def _eligible(gm: GraphModule, node: Node) -> _Conv | None:
    """The conv's parts, if oneDNN's kernel computes exactly what it does: a constant fp32/bf16
    4-D weight, a 4-D input with static channels (other sizes symbolic with a traced value, or
    static), explicit integer padding."""
    kw = call_kwargs(node)
    if kw is None:
        return None
    weight = constant_tensor(gm, kw.get("weight"))
    x = meta_val(kw["input"])
    shape = size_hints(x)
    # Packing copies the weight, as folding does: valid for an inference capture (ctx.training
    # is False), which the module captures anew when called with gradients enabled.
    if (weight is None or weight.dim() != 4
            or weight.dtype not in (torch.float32, torch.bfloat16) or weight.is_mkldnn
            or not isinstance(x, torch.Tensor) or x.dim() != 4 or x.dtype != weight.dtype
            or shape is None or not is_concrete_int(x.shape[1])):
        return None
    bias = kw.get("bias")
    if bias is not None and constant_tensor(gm, bias) is None:
        return None

    def pair(value: Any, default: int) -> list[int] | None:
        value = [default] if value is None else list(value) if not isinstance(value, int) \
            else [value]
        value = value * 2 if len(value) == 1 else value
        return value if len(value) == 2 and all(isinstance(v, int) for v in value) else None

    padding, stride, dilation = (pair(kw.get("padding"), 0), pair(kw.get("stride"), 1),
                                 pair(kw.get("dilation"), 1))
    groups = kw.get("groups", 1)
    if padding is None or stride is None or dilation is None or not isinstance(groups, int):
        return None
    return _Conv(node, kw["input"], weight.detach(), bias, padding, stride, dilation, groups,
                 list(shape))


def _epilogue(conv: Node) -> tuple[Node | None, Node | None, list[tuple[Node, _Epilogue]]]:
    """What oneDNN can fuse after the conv: ``(add, other operand, [(unary node, epilogue)])``.

    An add is fused when it is the conv's only user, adds with alpha 1 a tensor of exactly the
    conv's shape and dtype, and writes (if in place) only into the conv's own output. A unary
    op is fused when it is the only user of what it follows.
    """
    add = other = None
    tail = conv
    users = list(conv.users)
    if len(users) == 1 and users[0].target in _RESIDUAL_ADD:
        candidate = users[0]
        kw = call_kwargs(candidate) or {}
        a, b = kw.get("input"), kw.get("other")
        operand = b if a is conv else a if (b is conv and candidate.target is aten.add.Tensor) \
            else None
        out, val = meta_val(conv), meta_val(operand)
        if (operand is not None and operand is not conv and kw.get("alpha", 1) == 1
                and isinstance(val, torch.Tensor) and isinstance(out, torch.Tensor)
                and _same_shape(val, out) and val.dtype == out.dtype):
            add, other, tail = candidate, operand, candidate
    users = list(tail.users)
    unary: list[tuple[Node, _Epilogue]] = []
    if len(users) == 1 and users[0].target in UNARY:
        kw = call_kwargs(users[0]) or {}
        epilogue = UNARY[users[0].target](kw)
        # After an add, oneDNN's binary kernel fuses ReLU only ("Unary Fusion behavior
        # undefined" for the rest): other activations stay separate ops.
        if kw.get("input", kw.get("self")) is tail and (add is None or epilogue[0] == "relu"):
            unary = [(users[0], epilogue)]
    return add, other, unary


def _pays(gm: GraphModule, ctx: PassContext, conv: _Conv, kernel: PackedConv,
          other: Node | None) -> bool:
    """Whether the cost model measures the fused oneDNN kernel at least as fast as ATen's
    conv followed by its epilogue, on random inputs of the real shapes (channels-last, the
    layout oneDNN's outputs give the ops after them)."""
    def like(node: Node) -> torch.Tensor:
        value = meta_val(node)
        return torch.randn(size_hints(value), dtype=value.dtype).contiguous(
            memory_format=torch.channels_last)

    x = like(conv.input)
    r = like(other) if other is not None else None
    bias = attr(gm, conv.bias) if conv.bias is not None else None
    dynamic = has_symbolic_size(meta_val(conv.input))
    what = (f"conv2d|{tuple(x.shape)}|{tuple(conv.weight.shape)}|{x.dtype}|{kernel.geometry}|"
            f"add={r is not None}|{kernel.epilogue[0] if kernel.epilogue else 'none'}"
            + ("|dynamic" if dynamic else ""))
    best, seconds = ctx.cost.fastest(what, {"onednn": lambda: kernel(x, bias, r),
                                            "aten": lambda: kernel.reference(x, bias, r)})
    log.debug("%s: %s", what, seconds)
    return best == "onednn"


def _same_shape(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal shapes, known without a guard: comparing symbolic sizes with ``==`` would add
    one to the graph and fix its sizes."""
    return a.dim() == b.dim() and all(
        statically_known_true(x == y) for x, y in zip(a.shape, b.shape, strict=True))


def _reference_unary(epilogue: _Epilogue) -> Callable[[torch.Tensor], torch.Tensor]:
    name, scalars, algorithm = epilogue
    fns: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
        "relu": torch.relu, "sigmoid": torch.sigmoid, "tanh": torch.tanh,
        "hardswish": torch.nn.functional.hardswish,
        "hardsigmoid": torch.nn.functional.hardsigmoid, "swish": torch.nn.functional.silu,
        "hardtanh": lambda t: torch.nn.functional.hardtanh(t, *scalars),
        "leaky_relu": lambda t: torch.nn.functional.leaky_relu(t, *scalars),
        "gelu": lambda t: torch.nn.functional.gelu(t, approximate=algorithm),
    }
    return fns[name]
