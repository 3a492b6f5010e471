"""Dynamic int8 quantization of linear layers, for CPU inference.

    x ─ linear(W, b) ─ y      ⟶      x ─ quantized.linear_dynamic(pack(int8(W), b)) ─ y
    x ─ addmm(b, x, W) ─ y    ⟶      (the same, with W's transpose: a weight stored (in, out))

The weight is quantized once, per output channel (symmetric int8); the activation is quantized
per call from its own range, so no calibration data is needed. The quantized kernel computes
in int8 with int32 accumulation and returns fp32, so the rest of the graph is untouched.

The kernel takes one activation scale for the whole input, so with more than one row (a batch
of decode steps, a prompt's tokens) the row with the largest values sets the step for all.
Each row is therefore divided by its own largest magnitude first and multiplied back after
(the matmul is linear in each row), with the bias added after:

    x ─ m = amax(|x|, -1) ─ linear_dynamic(x / m, pack(int8(W))) · m + b ─ y

Measured with bench/generate.py's models at batch 8 (random weights, 64 greedy tokens): tokens
equal to fp32 eager's 69% → 83% (Llama-style) and 60% → 92% (GPT-2), no slower.

Weight-only kernels (``weight_only.py``) are the other candidates: ``int8_weight`` (int8
weights, bf16 activations) beside the dynamic kernel (named ``int8``) under ``precision="int8"``,
and ``int4`` under ``precision="int4"``. Each linear's kernel is the one the cost model measures
fastest for its shape, against fp32's too (``slower_than_fp32``); the choice is kept in the
node's ``meta[KERNEL]``. Unmeasured (no cost model, or ``force``) int8 takes the dynamic kernel;
the ``kernel`` option of the precision pass names one for every linear.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch
from torch.fx import GraphModule, Interpreter, Node

from . import block_kernels, ops, weight_only
from .graph import attr, fresh_name, meta_val
from .packed_kernels import fbgemm_engine, fits_fp16, pack_fp16, quantized_engine

aten = torch.ops.aten

# oneDNN's int8 kernels use VNNI/AMX where the CPU has them (about 2x faster than the x86
# engine's FBGEMM at BERT-base shapes on Sapphire Rapids); the others are fallbacks.
_ENGINES = ("onednn", "x86", "fbgemm", "qnnpack")


def _operands(node: Node) -> tuple[Any, Any, Any, bool] | None:
    """``(x, weight, bias, transposed)`` of a linear, or of an ``addmm(bias, x, W)`` whose
    ``W`` is stored ``(in, out)`` (transformers' ``Conv1D``: GPT-2's every projection)."""
    if node.op != "call_function":
        return None
    if node.target in ops.LINEAR.aten:
        bias = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
        return node.args[0], node.args[1], bias, False
    if node.target is torch.ops.aten.addmm.default and len(node.args) == 3 \
            and not node.kwargs:  # beta = alpha = 1
        bias, x, weight = node.args
        return x, weight, bias, True
    return None


# node.meta key: the quantized kernel measured fastest for a linear (a name of KERNELS).
KERNEL = "autoopt_quantized_kernel"
# node.meta key: the quantized kernels measured faster than fp32 for it, fastest first.
FASTER = "autoopt_quantized_faster"
# The kernels of each precision, by the name they are measured under; the first is the one
# taken unmeasured.
KERNELS = {"int8": ("int8", "int8_fbgemm", "int8_blocks", "int8_weight"),
           "int4": ("int4", "int4_blocks")}
# What the report calls them.
KERNEL_NAMES = {"int8": "int8 dynamic (int8 activations)",
                "int8_fbgemm": "int8 dynamic, FBGEMM's (int8 activations)",
                "int8_weight": "int8 weight-only (bf16 activations)",
                "int4": "int4 weight-only (bf16 activations)",
                "int8_blocks": "int8 x int8 in blocks of 32 (autoopt's VNNI kernel)",
                "int4_blocks": "int4 x int8 in blocks of 32 (autoopt's VNNI kernel)",
                "fp16_panels": "fp16 weight-only (autoopt's AVX-512 kernel, fp32 activations)"}
# autoopt's own kernels (``block_kernels``): int8 and int4 in llama.cpp's manner, fp16 weights.
BLOCKS = ("int8_blocks", "int4_blocks", "fp16_panels")
# The dynamic kernels (int8 activations quantized per call): each packs for its engine.
DYNAMIC = ("int8", "int8_fbgemm")
# bf16 as weights alone (the precision pass's ``weight_only`` option, which ``optimize`` sets
# for a model that generates on a CPU whose bf16 GEMM is slower than fp32's): each linear's
# weight held in fp16 (a weight beyond fp16's range is not), fp32 activations, FBGEMM's fp16
# GEMM, where it measures faster than fp32's kernels. A decode step reads half the bytes and
# nothing else in the graph changes (no casts): on an Intel Xeon without AVX-512 BF16, 2048 x
# 768 at one row took 335 us against fp32's 480, where bf16 casts made the whole step no faster.
FP16_WEIGHT = "fp16_weight"
KERNEL_NAMES[FP16_WEIGHT] = "fp16 weight-only (FBGEMM's fp16 GEMM, fp32 activations)"
# The kernels whose weight is one packed object the graph holds as an attribute (the others'
# are tensors: weight-only int8 and int4).
_PACKED = (*DYNAMIC, FP16_WEIGHT)


def weight_only_bf16(precision: Any, options: Any) -> bool:
    """Whether ``precision="bf16"`` runs as fp16-weight linears (the ``weight_only`` option)."""
    return precision == "bf16" and bool((options or {}).get("weight_only"))


def kernel_set(precision: str, options: Any) -> tuple[str, ...]:
    """The kernels ``precision`` measures for a linear, in the order an unmeasured one takes."""
    return (FP16_WEIGHT, "fp16_panels") if weight_only_bf16(precision, options) \
        else KERNELS[precision]


def is_linear(node: Node) -> bool:
    return _operands(node) is not None


def _weight_of(gm: GraphModule, node: Node) -> torch.Tensor:
    """The linear's weight as ``(out, in)``."""
    operands = _operands(node)
    assert operands is not None, node.format_node()
    weight = attr(gm, operands[1])
    return weight.t() if operands[3] else weight


def kernels_for(gm: GraphModule, node: Node, precision: str, options: Any) -> tuple[str, ...]:
    """The kernels of ``precision`` that can compute this linear (the ``kernel`` option: only
    that one)."""
    weight = _weight_of(gm, node)
    group = group_size(options)
    # Asked only of the precision's own kernels: fp16's range check reads the whole weight.
    fits = {"int8": lambda: True, "int8_fbgemm": lambda: _fbgemm_engine() is not None,
            "int8_weight": lambda: weight_only.int8_weight_fits(weight),
            "int4": lambda: weight_only.int4_fits(weight, group),
            "int8_blocks": lambda: block_kernels.fits(weight) and _blocks_here(),
            "int4_blocks": lambda: block_kernels.fits(weight, group) and _blocks_here(),
            FP16_WEIGHT: lambda: fbgemm_engine() is not None and fits_fp16(weight),
            "fp16_panels": lambda: (block_kernels.fits_fp16(weight) and fits_fp16(weight)
                                    and _blocks_here())}
    wanted = options.get("kernel")
    return tuple(k for k in kernel_set(precision, options) if wanted in (None, k) and fits[k]())


def _blocks_here() -> bool:
    return block_kernels.unavailable() is None  # why not: logged once, where it is found


def group_size(options: Any) -> int:
    return int(options.get("group_size") or weight_only.DEFAULT_GROUP)


def int8_candidates(gm: GraphModule, precision: str = "int8",
                    options: Any = None) -> list[Node]:
    """Linear nodes (and ``addmm`` with a constant weight) with an fp32 input and a 2-D fp32
    weight attribute (a constant to pack), and a kernel of ``precision`` for its shape."""
    found = []
    for node in gm.graph.nodes:
        operands = _operands(node)
        if operands is None:
            continue
        x, weight, bias, _ = operands
        if not all(isinstance(a, Node) and a.op == "get_attr" for a in
                   ([weight] + ([bias] if bias is not None else []))):
            continue
        w = attr(gm, weight)
        b = attr(gm, bias) if bias is not None else None
        x_val = meta_val(x)
        if (isinstance(w, torch.Tensor) and w.dim() == 2 and w.dtype == torch.float32
                and isinstance(x_val, torch.Tensor) and x_val.dtype == torch.float32
                and x_val.dim() >= 2
                and (b is None or (isinstance(b, torch.Tensor) and b.dim() == 1))
                and kernels_for(gm, node, precision, options or {})):
            found.append(node)
    return found


def why_no_candidate(gm: GraphModule, precision: str, options: Any) -> str:
    """Why ``int8_candidates`` found no linear: the reason that applied, and what to do
    instead (ending in "drop precision=": the refusal adds no other hint)."""
    if weight_only_bf16(precision, options):
        return ("bf16 runs here as fp16-weight linears (no fast bf16 GEMM on this CPU), and "
                "no linear layer has an fp32 weight within fp16's range and an fp32 input. "
                "Drop precision=")
    linears = [n for n in gm.graph.nodes if is_linear(n)]
    stored = [n for n in linears if isinstance(_operands(n)[1], Node)
              and isinstance(w := attr(gm, _operands(n)[1]), torch.Tensor) and w.dim() == 2]
    # int8 and int4 quantize linears only: where convolutions hold most of the work, say so
    # (bf16 casts convolutions too).
    convs = _macs(gm, ops.CONV.aten)
    conv_heavy = convs >= _macs(gm, ops.LINEAR.aten | {aten.addmm.default})
    only = "int4 is weight-only for linear layers" if precision == "int4" else \
        "int8 quantizes linear layers only"
    heavy = f"{only}, and this model's multiply-adds are mostly in convolutions"
    instead = "precision='bf16', " if conv_heavy and convs else ""
    if not linears:
        return (f"{only}, and this model has none"
                + (": its multiply-adds are in convolutions" if convs else "")
                + ". Use precision='bf16', or drop precision=")
    tail = f"; {heavy}" if conv_heavy and convs else ""
    wanted = options.get("kernel")
    unfit = [n for n in stored if not kernels_for(gm, n, precision, options)]
    if stored and wanted == "int8_fbgemm" and _fbgemm_engine() is None:
        return ("the int8_fbgemm kernel is FBGEMM's, and this PyTorch build has no x86 "
                "quantized engine besides the one the int8 kernel packs for. Leave the kernel "
                "option out, or drop precision=")
    if stored and len(unfit) == len(stored):
        # The weight-only kernel's needs: the block kernels' are the same or more.
        kernel = wanted or next(k for k in KERNELS[precision] if k not in (*DYNAMIC, *BLOCKS))
        shapes = sorted({tuple(_weight_of(gm, n).shape) for n in unfit})
        other = ("leave the kernel option out (the dynamic int8 kernel takes any width)"
                 if wanted else "use precision='int8' (any width)")
        return (f"no linear layer fits the {kernel} kernel, which needs "
                f"{_widths_needed(kernel, group_size(options))}: this model's "
                f"(out, in) are {', '.join(map(str, shapes[:4]))}"
                + (f" and {len(shapes) - 4} more" if len(shapes) > 4 else "")
                + f"{tail}. {other[0].upper()}{other[1:]}, {instead}or drop precision=")
    return (f"no linear layer has an fp32 weight stored in the model and an fp32 input, which "
            f"the {precision} kernels take{tail}. Use {instead or 'fp32 weights, '}or drop "
            f"precision=")


def _widths_needed(kernel: str, group: int) -> str:
    if kernel == "fp16_panels":
        return "an input width that is a multiple of 4"
    if kernel in BLOCKS:
        return block_kernels.widths_needed(group if kernel == "int4_blocks" else 1)
    return weight_only.widths_needed(kernel, group)


def _macs(gm: GraphModule, targets: Any) -> int:
    """Multiply-adds of the nodes calling ``targets``: output elements times the weight's
    elements per output channel (a convolution's and a linear's alike)."""
    total = 0
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target not in targets:
            continue
        operands = _operands(node)
        transposed = bool(operands and operands[3])  # addmm's weight is (in, out)
        out, weight = meta_val(node), meta_val(node.args[2 if transposed else 1])
        if isinstance(out, torch.Tensor) and isinstance(weight, torch.Tensor) \
                and weight.dim() >= 2:
            total += out.numel() * (weight.numel() // weight.shape[1 if transposed else 0])
    return int(total)


def apply_int8(gm: GraphModule, names: Iterable[str] | Mapping[str, str],
               packed: dict[Any, Any], group: int = weight_only.DEFAULT_GROUP) -> int:
    """Replace the linear nodes named in ``names`` by quantized linears, in place.

    Args:
        gm: the graph module.
        names: linear nodes to quantize (from ``int8_candidates``); a mapping gives each one's
            kernel (a name of ``KERNELS``), otherwise the dynamic int8 one.
        packed: prepacked weights by node name and kernel, filled on first use and reused
            across trials.
        group: int4's group size.
    Returns:
        How many linears were replaced.
    """
    kernels = dict(names) if isinstance(names, Mapping) else dict.fromkeys(names, "int8")
    replaced = 0
    for node in list(gm.graph.nodes):
        kernel = kernels.get(node.name)
        if kernel is None:
            continue
        if kernel not in _PACKED:
            weight = _packed_for(gm, node, packed, kernel, group)
            with gm.graph.inserting_before(node):
                attrs = {}
                lowering = block_kernels if kernel in BLOCKS else weight_only
                for suffix, tensor in lowering.tensors(weight).items():
                    name = fresh_name(gm, f"{node.name}_{kernel}_{suffix}")
                    gm.register_buffer(name, tensor)
                    attrs[suffix] = gm.graph.get_attr(name)
                new = lowering.emit(gm, node, _input(node), weight, attrs, _bias(node))
            node.replace_all_uses_with(new)
            gm.graph.erase_node(node)
            replaced += 1
            continue
        name = fresh_name(gm, f"{node.name}_{'fp16' if kernel == FP16_WEIGHT else 'int8'}_packed")
        setattr(gm, name, _packed_for(gm, node, packed, kernel))
        with gm.graph.inserting_before(node), warnings.catch_warnings():
            # fx warns on get_attr of anything but a parameter, buffer or submodule; a packed
            # weight is a TorchScript object, which GraphModule holds as a plain attribute.
            warnings.simplefilter("ignore", UserWarning)
            weights = gm.graph.get_attr(name)
            new = _emit_fp16(gm, node, weights) if kernel == FP16_WEIGHT else \
                _emit(gm, node, weights)
        node.replace_all_uses_with(new)
        gm.graph.erase_node(node)
        replaced += 1
    return replaced


def slower(precision: str) -> str:
    return f"{precision} measured slower than fp32 here: "


SLOWER = slower("int8")


def slower_than_fp32(gm: GraphModule, ctx: Any, nodes: Iterable[Node]) -> dict[str, str]:
    """The linears whose quantized kernels (``KERNELS`` of ``ctx.options["precision"]``; the
    dynamic int8 one with its row scaling) the cost model all measures no faster than the
    fastest fp32 kernel for the same shape, each with why: on a CPU without VNNI (Zen 3) an
    int8 decode step measured slower than fp32's, and at a few hundred multiply-adds quantizing
    the input costs more than the product. Every other linear's fastest quantized kernel goes
    into its ``meta[KERNEL]``. Not measured (every node may be quantized, with the first
    kernel): without a cost model, or with the precision pass's ``force`` option."""
    if ctx.cost is None or ctx.options.get("force"):
        return {}
    from .packed_linear import against_fp32, weights_outgrow_cache  # its fp32 kernels

    precision = ctx.options.get("precision") or "int8"
    group = group_size(ctx.options)
    makes: dict[str, Callable[..., Any]] = {
        "int8_weight": lambda w, b, rowwise: _weight_only_call(weight_only.quantize_int8(w), b),
        "int4": lambda w, b, rowwise: _weight_only_call(weight_only.quantize_int4(w, group), b),
        **{k: lambda w, b, rowwise, k=k: _block_call(block_kernels.pack(k, w, group), b)
           for k in BLOCKS},
        "int8": lambda w, b, rowwise: int8_linear(w, b, rowwise),
        "int8_fbgemm": lambda w, b, rowwise: int8_linear(w, b, rowwise, _fbgemm_engine()),
        FP16_WEIGHT: lambda w, b, rowwise: fp16_linear(w, b)}
    own = kernel_set(precision, ctx.options)
    share = {"int8": 0.25, "int4": 0.125}.get(precision, 0.5)  # weight bytes over fp32's
    measured: dict[str, Any] = {}
    cold = weights_outgrow_cache(gm)
    slow = {}
    with _quiet_deprecation():
        for node in nodes:
            rowwise = _rowwise(node)
            first, *others = [
                (k, lambda w, b, k=k, rowwise=rowwise: makes[k](w, b, rowwise))
                for k in kernels_for(gm, node, precision, ctx.options)]
            result = against_fp32(gm, ctx, node, first[0], first[1], share, measured, cold,
                                  more=dict(others))
            if result is None:
                continue
            best, seconds = result
            fp32 = min(s for k, s in seconds.items() if k not in own)
            node.meta[FASTER] = tuple(sorted(
                (k for k in own if k in seconds and seconds[k] < fp32), key=seconds.__getitem__))
            if best in own:
                node.meta[KERNEL] = best
                continue
            mine = min((k for k in seconds if k in own), key=seconds.__getitem__)
            # Every kernel of the precision tried, so that a refusal names them all.
            others = ", ".join(f"{k} {seconds[k] * 1e6:.0f} us" for k in own
                               if k in seconds and k != mine)
            slow[node.name] = (f"{slower(precision)}{seconds[mine] * 1e6:.0f} us against "
                               f"{seconds[best] * 1e6:.0f} us ({best.removesuffix('_packed')})"
                               + (f"; its fastest kernel {mine}, also tried: {others}"
                                  if others else ""))
    return slow


def _weight_only_call(weight: Any, bias: torch.Tensor | None,
                      ) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda x: weight_only.linear(x, weight, bias)


def _block_call(weight: Any, bias: torch.Tensor | None,
                ) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda x: block_kernels.linear(x, weight, bias)


def int8_linear(weight: torch.Tensor, bias: torch.Tensor | None, rowwise: bool,
                engine: str | None = None) -> Callable[[torch.Tensor], torch.Tensor]:
    """What ``apply_int8`` puts in a linear's place, as a function of its input: ``weight``
    ``(out, in)`` quantized and packed once (for ``engine``; ``int8_engine()`` by default)."""
    pack = _pack(weight.detach().contiguous(), None if rowwise or bias is None
                 else bias.detach(), engine)
    return lambda x: _int8_call(x, pack, rowwise, bias)


def fp16_linear(weight: torch.Tensor, bias: torch.Tensor | None,
                ) -> Callable[[torch.Tensor], torch.Tensor]:
    """The fp16-weight linear ``apply_int8`` puts in a linear's place, as a function of its
    input: ``weight`` ``(out, in)`` packed once in fp16 for FBGEMM."""
    pack = pack_fp16(weight)
    return lambda x: _fp16_call(x, pack, bias)


def _fp16_call(x: torch.Tensor, pack: Any, bias: torch.Tensor | None) -> torch.Tensor:
    y = torch.ops.quantized.linear_dynamic_fp16(x, pack)
    return y if bias is None else aten.add(y, bias)


def _emit_fp16(gm: GraphModule, node: Node, weights: Node) -> Node:
    """The fp16-weight linear's nodes, before ``node`` (the bias added after, in fp32)."""
    y = _call(gm.graph, torch.ops.quantized.linear_dynamic_fp16.default,
              (_input(node), weights), meta_val(node))
    bias = _bias(node)
    return y if bias is None else _call(gm.graph, aten.add.Tensor, (y, bias), meta_val(node))


def _int8_call(x: torch.Tensor, pack: Any, rowwise: bool,
               bias: torch.Tensor | None) -> torch.Tensor:
    """The int8 linear ``_emit`` writes into the graph, run eagerly (the bias is in ``pack``
    unless the rows are scaled)."""
    if not rowwise:
        return torch.ops.quantized.linear_dynamic(x, pack, REDUCE_RANGE)
    scale = aten.clamp_min(aten.amax(aten.abs(x), [-1], True), _TINY)
    y = aten.mul(torch.ops.quantized.linear_dynamic(aten.div(x, scale), pack, REDUCE_RANGE),
                 scale)
    return y if bias is None else aten.add(y, bias)


class Int8Interpreter(Interpreter):
    """Runs ``gm`` as ``apply_int8(gm, names, packed)`` would rewrite it, without rewriting it
    (for measuring many candidate sets)."""

    def __init__(self, gm: GraphModule, names: Iterable[str] | Mapping[str, str],
                 packed: dict[Any, Any], group: int = weight_only.DEFAULT_GROUP) -> None:
        super().__init__(gm)
        self.kernels = dict(names) if isinstance(names, Mapping) else dict.fromkeys(names,
                                                                                   "int8")
        self.packed = packed
        self.group = group

    def run_node(self, n: Node) -> Any:
        kernel = self.kernels.get(n.name)
        if kernel is None:
            return super().run_node(n)
        bias = _bias(n)
        bias = None if bias is None else self.env[bias]
        weight = _packed_for(self.module, n, self.packed, kernel, self.group)
        if kernel == FP16_WEIGHT:
            return _fp16_call(self.env[_input(n)], weight, bias)
        if kernel in BLOCKS:
            return block_kernels.linear(self.env[_input(n)], weight, bias)
        if kernel not in DYNAMIC:
            return weight_only.linear(self.env[_input(n)], weight, bias)
        return _int8_call(self.env[_input(n)], weight, _rowwise(n), bias)


# A row of zeros keeps a step of 1 instead of dividing by zero.
_TINY = 1e-12


def _without_vnni() -> bool:
    probe = getattr(torch.cpu, "_is_vnni_supported", None)
    return not probe() if callable(probe) else True


# Activations quantized to 7 bits instead of 8 on an x86 CPU without VNNI (Skylake, Zen 3):
# there FBGEMM multiplies u8 by s8 with vpmaddubsw, whose int16 sum of two products saturates
# on 8-bit activations (measured on a Skylake Xeon, 8 x 768 -> 768: max error 0.143 against
# 0.039 with 7 bits, outputs up to 2.0). torch.ao's x86 qconfig makes the same choice.
REDUCE_RANGE = _without_vnni()


def _rowwise(node: Node) -> bool:
    """Whether the input may have more than one row (a symbolic count may)."""
    x = meta_val(_input(node))
    rows = 1
    for size in x.shape[:-1]:
        rows = rows * size
    return not (isinstance(rows, int) and rows == 1)


def _emit(gm: GraphModule, node: Node, weights: Node) -> Node:
    """The int8 linear's nodes, before ``node``; the last one gives the result."""
    graph, x = gm.graph, _input(node)
    if not _rowwise(node):
        return _call(graph, torch.ops.quantized.linear_dynamic.default,
                     (x, weights, REDUCE_RANGE), meta_val(node))
    x_val = meta_val(x)
    scale_val = aten.amax.default(aten.abs.default(x_val), [-1], True)
    magnitude = _call(graph, aten.abs.default, (x,), x_val)
    largest = _call(graph, aten.amax.default, (magnitude, [-1], True), scale_val)
    scale = _call(graph, aten.clamp_min.default, (largest, _TINY), scale_val)
    scaled = _call(graph, aten.div.Tensor, (x, scale), x_val)
    y = _call(graph, torch.ops.quantized.linear_dynamic.default,
              (scaled, weights, REDUCE_RANGE), meta_val(node))
    y = _call(graph, aten.mul.Tensor, (y, scale), meta_val(node))
    bias = _bias(node)
    return y if bias is None else _call(graph, aten.add.Tensor, (y, bias), meta_val(node))


def _call(graph: Any, target: Any, args: tuple[Any, ...], val: Any) -> Node:
    new = graph.call_function(target, args)
    new.meta["val"] = val
    return new


def _bias(node: Node) -> Node | None:
    operands = _operands(node)
    assert operands is not None, node.format_node()
    return operands[2]


def _packed_for(gm: Any, node: Node, packed: dict[Any, Any], kernel: str = "int8",
                group: int = weight_only.DEFAULT_GROUP) -> Any:
    """The quantized weight for ``kernel``: the dynamic int8 one with the bias inside unless
    the rows are scaled (added after); a weight-only one without (added after)."""
    key = (node.name, kernel)
    if key not in packed:
        operands = _operands(node)
        assert operands is not None, node.format_node()
        _, weight_node, bias_node, transposed = operands
        weight = attr(gm, weight_node)
        weight = weight.t().contiguous() if transposed else weight
        if kernel == FP16_WEIGHT:
            packed[key] = pack_fp16(weight)
        elif kernel == "int8_weight":
            packed[key] = weight_only.quantize_int8(weight)
        elif kernel == "int4":
            packed[key] = weight_only.quantize_int4(weight, group)
        elif kernel in BLOCKS:
            packed[key] = block_kernels.pack(kernel, weight, group)
        else:
            bias = attr(gm, bias_node) if bias_node is not None and not _rowwise(node) \
                else None
            packed[key] = _pack(weight.detach(), None if bias is None else bias.detach(),
                                _fbgemm_engine() if kernel == "int8_fbgemm" else None)
    return packed[key]


def _input(node: Node) -> Node:
    operands = _operands(node)
    assert operands is not None, node.format_node()
    return operands[0]


def int8_engine() -> str | None:
    """The quantized engine to pack with, or None when this build has none."""
    supported = torch.backends.quantized.supported_engines
    return next((e for e in _ENGINES if e in supported), None)


def _fbgemm_engine() -> str | None:
    """The engine ``int8_fbgemm`` packs for (FBGEMM's, measured beside oneDNN's: on an AMD
    EPYC with AVX-512 VNNI and no AMX it streams a decode step's weights 1.3-1.5x faster, 768
    x 768 at one row, 1 thread, weights out of cache: 48 against 73 us): None where this build
    has none, or where it is the one ``int8`` packs for already (no second kernel)."""
    found = fbgemm_engine()
    return None if found == int8_engine() else found


def _pack(weight: torch.Tensor, bias: torch.Tensor | None, engine: str | None = None) -> Any:
    # Symmetric per-output-channel scales: a row's largest magnitude maps to 127.
    scales = (weight.abs().amax(dim=1).clamp_min(1e-12) / 127.0).to(torch.float64)
    zeros = torch.zeros(weight.shape[0], dtype=torch.int64)
    with quantized_engine(engine or int8_engine()), _quiet_deprecation():
        q = torch.quantize_per_channel(weight, scales, zeros, 0, torch.qint8)
        return torch.ops.quantized.linear_prepack(q, bias)


@contextlib.contextmanager
def _quiet_deprecation() -> Iterator[None]:
    # torch warns that quantized tensor constructors are deprecated; autoopt only packs with
    # them and reports its own choices.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        yield
