"""Random small models for the fuzzer, built from a readable spec.

A spec is a list of ``Step``s applied in order to one running tensor whose layout is one of

    "2d"   (B, C, H, W)    conv2d + BatchNorm2d, channels-last round trips
    "1d"   (B, C, L)       conv1d + BatchNorm1d
    "seq"  (B, T, D)       linear, attention, LayerNorm, head split/merge views
    "flat" (N, D)          linear + BatchNorm1d

so every op family the passes touch (and the no-ops around them) appears in the positions real
models put it. Hypothesis draws the spec (``model_specs``), shrinks it when a case fails, and
prints it as the falsifying example; ``build`` turns it into an ``nn.Module`` and its input.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from hypothesis import strategies as st
from torch import nn

from autoopt.passes import PASS_NAMES

ACTIVATIONS = ("relu", "gelu", "silu", "hardswish", "tanh")
# Elementwise ops with a scalar, including the ones remove_noops must drop (x*1, x+0, ...)
# and the reversed forms a graph spells as rsub/rmul.
SCALAR_OPS = ("mul1", "add0", "sub0", "div1", "rmul1", "radd0", "mul", "add", "rsub", "div")
VIEW_ROUND_TRIPS = ("view_same", "reshape_same", "permute_identity", "transpose_twice",
                    "contiguous", "to_same", "full_slice", "flatten_unflatten")
CAPTURES = (("export", "symbolic_trace", "dynamo"), ("symbolic_trace", "dynamo"), ("dynamo",))


@dataclass(frozen=True)
class Step:
    """One block of the model: ``op`` names it, ``opts`` are its knobs (sorted for printing)."""

    op: str
    opts: tuple[tuple[str, Any], ...] = ()

    def get(self, key: str, default: Any = None) -> Any:
        return dict(self.opts).get(key, default)


@dataclass(frozen=True)
class ModelSpec:
    """Everything needed to rebuild one random model and its example input.

    Args:
        layout: the input's layout ("2d", "1d", "seq", "flat").
        batch: the leading dimension.
        width: channels (2d/1d) or features (seq/flat) of the input.
        size: spatial size (2d: H=W, 1d: L) or sequence length (seq); unused for flat.
        dtype: the model's and input's dtype.
        train: put the whole model in train mode (BatchNorm uses batch statistics).
        steps: the blocks, in order.
        outputs: "tensor", "tuple" or "dict" (the latter two include tapped intermediates).
        seed: for the weights and statistics.
    """

    layout: str
    batch: int
    width: int
    size: int
    dtype: torch.dtype
    train: bool
    steps: tuple[Step, ...]
    outputs: str
    seed: int = 0


@dataclass(frozen=True)
class FuzzCase:
    """A model spec plus how to optimize it."""

    spec: ModelSpec
    disable: tuple[str, ...] = ()
    capture: tuple[str, ...] = CAPTURES[0]
    options: dict[str, Any] = field(default_factory=dict)


# --- building blocks ----------------------------------------------------------------------


def _activation(name: str | None, x: torch.Tensor) -> torch.Tensor:
    if name is None:
        return x
    return {"relu": F.relu, "gelu": F.gelu, "silu": F.silu, "hardswish": F.hardswish,
            "tanh": torch.tanh}[name](x)


def _randomize_bn(bn: nn.modules.batchnorm._BatchNorm, gen: torch.Generator) -> None:
    """Non-trivial statistics and affine terms, so a wrong fold shows up in the numbers."""
    n = bn.num_features
    with torch.no_grad():
        if bn.running_mean is not None and bn.running_var is not None:
            bn.running_mean.copy_(torch.randn(n, generator=gen) * 0.5)
            bn.running_var.copy_(torch.rand(n, generator=gen) + 0.5)
        if bn.affine:
            bn.weight.copy_(torch.randn(n, generator=gen) * 0.5 + 1.0)
            bn.bias.copy_(torch.randn(n, generator=gen) * 0.5)


class ConvBlock(nn.Module):
    """conv(1d/2d, optionally transposed or depthwise) [-> BatchNorm] [-> activation]."""

    def __init__(self, step: Step, dims: int, c_in: int, gen: torch.Generator) -> None:
        super().__init__()
        c_out, k = step.get("c_out"), step.get("kernel")
        conv_cls: type[nn.Module]
        if step.get("transposed"):
            conv_cls = nn.ConvTranspose1d if dims == 1 else nn.ConvTranspose2d
            self.conv = conv_cls(c_in, c_out, k, padding=k // 2, bias=step.get("bias"))
        else:
            conv_cls = nn.Conv1d if dims == 1 else nn.Conv2d
            groups = c_in if step.get("depthwise") and c_out % c_in == 0 else 1
            self.conv = conv_cls(c_in, c_out, k, padding=k // 2, bias=step.get("bias"),
                                 groups=groups)
        self.bn: nn.Module | None = None
        bn_mode = step.get("bn")
        if bn_mode is not None:
            bn_cls = nn.BatchNorm1d if dims == 1 else nn.BatchNorm2d
            bn = bn_cls(c_out, affine=step.get("affine", True))
            _randomize_bn(bn, gen)
            self.bn = bn
            self.bn_train = bn_mode == "train"
        self.act = step.get("act")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(x)
        if self.bn is not None:
            y = self.bn(y)
        return _activation(self.act, y)


class LinearBlock(nn.Module):
    """linear [-> BatchNorm1d (flat layout only)] [-> activation]."""

    def __init__(self, step: Step, d_in: int, gen: torch.Generator) -> None:
        super().__init__()
        d_out = step.get("d_out")
        self.linear = nn.Linear(d_in, d_out, bias=step.get("bias"))
        self.bn: nn.Module | None = None
        if step.get("bn") is not None:
            bn = nn.BatchNorm1d(d_out, affine=step.get("affine", True))
            _randomize_bn(bn, gen)
            self.bn = bn
            self.bn_train = step.get("bn") == "train"
        self.act = step.get("act")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear(x)
        if self.bn is not None:
            y = self.bn(y)
        return _activation(self.act, y)


class Attention(nn.Module):
    """Multi-head self-attention, hand-written (``q @ k^T * scale``, optional mask, softmax,
    ``@ v``) or through ``F.scaled_dot_product_attention``.

        x ─ qkv ─ split heads ─ q @ kᵀ · s ─ [mask] ─ softmax ─ [dropout] ─ @ v ─ merge ─ proj
    """

    def __init__(self, step: Step, d: int, seq: int) -> None:
        super().__init__()
        self.heads = step.get("heads")
        self.kind = step.get("kind")  # "manual" or "sdpa"
        self.mask = step.get("mask")  # None, "bool" or "additive"
        self.fused_qkv = step.get("fused_qkv")
        if self.fused_qkv:
            self.qkv = nn.Linear(d, 3 * d)
        else:
            self.q, self.k, self.v = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)
        self.proj = nn.Linear(d, d)
        self.dropout = nn.Dropout(step.get("p", 0.0))
        causal = torch.ones(seq, seq, dtype=torch.bool).tril()
        self.register_buffer("causal", causal, persistent=False)
        additive = torch.zeros(seq, seq).masked_fill(~causal, float("-inf"))
        self.register_buffer("additive", additive, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape  # (B, T, D)
        h = self.heads
        if self.fused_qkv:
            q, k, v = self.qkv(x).chunk(3, dim=-1)
        else:
            q, k, v = self.q(x), self.k(x), self.v(x)
        q, k, v = (z.view(b, t, h, d // h).transpose(1, 2) for z in (q, k, v))  # (B, h, T, d/h)
        if self.kind == "sdpa":
            mask = None
            if self.mask == "bool":
                mask = self.causal[:t, :t]
            elif self.mask == "additive":
                mask = self.additive[:t, :t].to(x.dtype)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        else:
            scores = q @ k.transpose(-2, -1) * (1.0 / math.sqrt(d // h))  # (B, h, T, T)
            if self.mask == "bool":
                scores = scores.masked_fill(~self.causal[:t, :t], float("-inf"))
            elif self.mask == "additive":
                scores = scores + self.additive[:t, :t].to(x.dtype)
            y = self.dropout(scores.softmax(dim=-1)) @ v
        y = y.transpose(1, 2).reshape(b, t, d)  # (B, T, D)
        return self.proj(y)


class ScalarOp(nn.Module):
    def __init__(self, step: Step) -> None:
        super().__init__()
        self.kind, self.value = step.get("kind"), step.get("value", 1.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c = self.value
        return {
            "mul1": lambda: x * 1, "add0": lambda: x + 0, "sub0": lambda: x - 0,
            "div1": lambda: x / 1, "rmul1": lambda: 1 * x, "radd0": lambda: 0 + x,
            "mul": lambda: x * c, "add": lambda: x + c, "rsub": lambda: c - x,
            "div": lambda: x / c,
        }[self.kind]()


class ViewRoundTrip(nn.Module):
    """Views, permutes and casts that leave the tensor as it was (or a layout round trip)."""

    def __init__(self, step: Step) -> None:
        super().__init__()
        self.kind = step.get("kind")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kind = self.kind
        if kind == "view_same":
            return x.view(x.shape)
        if kind == "reshape_same":
            return x.reshape(*x.shape)
        if kind == "permute_identity":
            return x.permute(*range(x.dim()))
        if kind == "transpose_twice":
            return x.transpose(0, -1).transpose(0, -1)
        if kind == "contiguous":
            return x.contiguous()
        if kind == "to_same":
            return x.to(x.dtype)
        if kind == "full_slice":
            return x[:, : x.shape[1]]
        # flatten_unflatten: a real reshape pair around an activation.
        shape = x.shape
        return torch.relu(x.flatten(1)).view(shape)


class InPlace(nn.Module):
    """A no-op-looking copy (``x * 1``, ``x + 0``) that is then written in place: dropping the
    copy would write into ``x``, which is still used after."""

    def __init__(self, step: Step) -> None:
        super().__init__()
        self.kind = step.get("kind")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "mul1_add_":
            y = x * 1
            y.add_(1.0)
        elif self.kind == "add0_relu_":
            y = x + 0
            torch.relu_(y)
        else:  # "iadd"
            y = x * 1
            y += 1.0
        return y * x


class HeadSplit(nn.Module):
    """(B, T, D) -> (B, h, T, D/h) -> back, the reshape/permute dance of attention."""

    def __init__(self, step: Step) -> None:
        super().__init__()
        self.heads = step.get("heads")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        y = x.view(b, t, self.heads, d // self.heads).permute(0, 2, 1, 3)
        y = y * 2.0
        return y.permute(0, 2, 1, 3).reshape(b, t, d)


class Dropout(nn.Module):
    def __init__(self, step: Step) -> None:
        super().__init__()
        self.p, self.functional = step.get("p"), step.get("functional")
        self.module = nn.Dropout(self.p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.functional:
            return F.dropout(x, self.p, training=self.training)
        return self.module(x)


class Residual(nn.Module):
    """x + f(x), where f keeps the shape; optionally scaled (``x + 0.5 * f(x)``)."""

    def __init__(self, inner: nn.Module, scale: float) -> None:
        super().__init__()
        self.inner, self.scale = inner, scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.scale * self.inner(x)


class SharedTwice(nn.Module):
    """One module (tied weights) used twice: f(act(f(x))), optionally a BatchNorm after only
    the second use, so folding it into the shared weight would change the first use."""

    def __init__(self, layer: nn.Module, bn: nn.Module | None, act: str | None) -> None:
        super().__init__()
        self.layer, self.bn, self.act = layer, bn, act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.layer(_activation(self.act or "relu", self.layer(x)))
        return self.bn(y) if self.bn is not None else y


class TiedPair(nn.Module):
    """Two Linear modules sharing one weight Parameter (as embeddings and LM heads do)."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(d, d), nn.Linear(d, d)
        self.b.weight = self.a.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)))


class Transition(nn.Module):
    """Change layout: 2d/1d -> seq (tokens), seq/2d/1d -> flat (pooling)."""

    def __init__(self, step: Step) -> None:
        super().__init__()
        self.kind = step.get("kind")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kind = self.kind
        if kind == "2d_to_seq":
            return x.flatten(2).transpose(1, 2)  # (B, HW, C)
        if kind == "1d_to_seq":
            return x.transpose(1, 2)  # (B, L, C)
        if kind == "2d_to_flat":
            return F.adaptive_avg_pool2d(x, 1).flatten(1)
        if kind == "1d_to_flat":
            return x.mean(-1)
        if kind == "seq_to_flat_mean":
            return x.mean(1)
        return x[:, 0]  # seq_to_flat_first: a class token


class FuzzNet(nn.Module):
    """The steps in order; ``Tap`` steps keep the running value as an extra output."""

    def __init__(self, blocks: list[nn.Module | None], outputs: str) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([b if b is not None else nn.Identity() for b in blocks])
        self.taps = [b is None for b in blocks]
        self.outputs = outputs

    def forward(self, x: torch.Tensor) -> Any:
        tapped = []
        for block, tap in zip(self.blocks, self.taps, strict=True):
            if tap:
                tapped.append(x)
            x = block(x)
        if self.outputs == "tuple":
            return (x, *tapped)
        if self.outputs == "dict":
            return {"out": x, **{f"tap{i}": t for i, t in enumerate(tapped)}}
        return x


# --- spec -> module ------------------------------------------------------------------------


def _block(step: Step, layout: str, width: int, size: int, gen: torch.Generator,
           ) -> tuple[nn.Module | None, str, int, int]:
    """The module for ``step`` and the layout, width and size after it."""
    op = step.op
    dims = 1 if layout == "1d" else 2
    if op == "conv":
        return ConvBlock(step, dims, width, gen), layout, step.get("c_out"), size
    if op == "linear":
        return LinearBlock(step, width, gen), layout, step.get("d_out"), size
    if op == "act":
        return _Act(step.get("kind")), layout, width, size
    if op == "dropout":
        return Dropout(step), layout, width, size
    if op == "scalar":
        return ScalarOp(step), layout, width, size
    if op == "view":
        return ViewRoundTrip(step), layout, width, size
    if op == "heads":
        return HeadSplit(step), layout, width, size
    if op == "inplace":
        return InPlace(step), layout, width, size
    if op == "layernorm":
        return nn.LayerNorm(width, elementwise_affine=step.get("affine")), layout, width, size
    if op == "attention":
        return Attention(step, width, size), layout, width, size
    if op == "residual":
        inner, _, _, _ = _block(step.get("inner"), layout, width, size, gen)
        assert inner is not None
        return Residual(inner, step.get("scale")), layout, width, size
    if op == "shared":
        if layout in ("2d", "1d"):
            conv = (nn.Conv1d if dims == 1 else nn.Conv2d)(width, width, 3, padding=1)
            bn: nn.Module | None = None
            if step.get("bn"):
                bn = (nn.BatchNorm1d if dims == 1 else nn.BatchNorm2d)(width)
                _randomize_bn(bn, gen)  # type: ignore[arg-type]
            return SharedTwice(conv, bn, step.get("act")), layout, width, size
        return SharedTwice(nn.Linear(width, width), None, step.get("act")), layout, width, size
    if op == "tied":
        return TiedPair(width), layout, width, size
    if op == "tap":
        return None, layout, width, size
    if op == "transition":
        kind = step.get("kind")
        new_layout = kind.split("_to_")[1].split("_")[0]
        new_size = size * size if kind == "2d_to_seq" else size
        return Transition(step), new_layout, width, new_size
    raise ValueError(f"unknown step {op}")


class _Act(nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _activation(self.kind, x)


def build(spec: ModelSpec) -> tuple[nn.Module, torch.Tensor]:
    """The model for ``spec`` (weights from ``spec.seed``) and an example input."""
    gen = torch.Generator().manual_seed(spec.seed)
    torch.manual_seed(spec.seed)
    layout, width, size = spec.layout, spec.width, spec.size
    blocks = []
    for step in spec.steps:
        block, layout, width, size = _block(step, layout, width, size, gen)
        blocks.append(block)
    model = FuzzNet(blocks, spec.outputs)
    model.train(spec.train)
    for module in model.modules():
        if isinstance(module, (ConvBlock, LinearBlock)) and module.bn is not None:
            module.bn.train(spec.train or module.bn_train)
    model.to(spec.dtype)
    shape = {"2d": (spec.batch, spec.width, spec.size, spec.size),
             "1d": (spec.batch, spec.width, spec.size),
             "seq": (spec.batch, spec.size, spec.width),
             "flat": (spec.batch, spec.width)}[spec.layout]
    x = torch.randn(shape, generator=gen).to(spec.dtype)
    return model, x


# --- strategies ----------------------------------------------------------------------------

_ACT_OR_NONE = st.sampled_from((None, *ACTIVATIONS))


def _opts(**kwargs: Any) -> tuple[tuple[str, Any], ...]:
    return tuple(sorted(kwargs.items()))


@st.composite
def _step(draw: st.DrawFn, layout: str, width: int, allow_train_bn: bool,
          shape_preserving: bool = False) -> Step:
    """One step valid for ``layout``; ``shape_preserving`` for the inside of a residual."""
    choices = ["act", "dropout", "scalar", "view", "residual", "tap", "shared", "inplace"]
    if layout in ("2d", "1d"):
        choices += ["conv", "conv", "conv"]
        if not shape_preserving:
            choices += ["transition"]
    if layout in ("seq", "flat"):
        choices += ["linear", "linear", "layernorm", "tied"]
    if layout == "seq":
        choices += ["attention", "attention", "heads"]
        if not shape_preserving:
            choices += ["transition"]
    if shape_preserving:
        choices = [c for c in choices if c not in ("residual", "tap")]
    op = draw(st.sampled_from(choices))
    bn_modes = ("eval", "train") if allow_train_bn else ("eval",)
    if op == "conv":
        c_out = width if shape_preserving else draw(st.sampled_from((width, 2, 4, 6, 8)))
        transposed = draw(st.booleans()) and draw(st.booleans())
        return Step(op, _opts(
            c_out=c_out, kernel=draw(st.sampled_from((1, 3))), bias=draw(st.booleans()),
            transposed=transposed, depthwise=not transposed and draw(st.booleans()),
            bn=draw(st.sampled_from((None, *bn_modes, "eval"))), affine=draw(st.booleans()),
            act=draw(_ACT_OR_NONE)))
    if op == "linear":
        d_out = width if shape_preserving else draw(st.sampled_from((width, 4, 8, 12)))
        bn = draw(st.sampled_from((None, *bn_modes, "eval"))) if layout == "flat" else None
        return Step(op, _opts(d_out=d_out, bias=draw(st.booleans()), bn=bn,
                              affine=draw(st.booleans()), act=draw(_ACT_OR_NONE)))
    if op == "act":
        return Step(op, _opts(kind=draw(st.sampled_from(ACTIVATIONS))))
    if op == "dropout":
        return Step(op, _opts(p=draw(st.sampled_from((0.0, 0.1, 0.5))),
                              functional=draw(st.booleans())))
    if op == "scalar":
        return Step(op, _opts(kind=draw(st.sampled_from(SCALAR_OPS)),
                              value=draw(st.sampled_from((0.5, 2.0, -1.0, 3)))))
    if op == "view":
        return Step(op, _opts(kind=draw(st.sampled_from(VIEW_ROUND_TRIPS))))
    if op == "inplace":
        return Step(op, _opts(kind=draw(st.sampled_from(("mul1_add_", "add0_relu_", "iadd")))))
    if op == "heads":
        return Step(op, _opts(heads=draw(st.sampled_from([h for h in (1, 2, 4)
                                                            if width % h == 0]))))
    if op == "layernorm":
        return Step(op, _opts(affine=draw(st.booleans())))
    if op == "attention":
        return Step(op, _opts(
            heads=draw(st.sampled_from([h for h in (1, 2, 4) if width % h == 0])),
            kind=draw(st.sampled_from(("manual", "sdpa"))),
            mask=draw(st.sampled_from((None, "bool", "additive"))),
            fused_qkv=draw(st.booleans()), p=draw(st.sampled_from((0.0, 0.1)))))
    if op == "residual":
        inner = draw(_step(layout, width, allow_train_bn, shape_preserving=True))
        return Step(op, _opts(inner=inner, scale=draw(st.sampled_from((1.0, 0.5)))))
    if op == "shared":
        bn = layout in ("2d", "1d") and draw(st.booleans())
        return Step(op, _opts(bn=bn, act=draw(_ACT_OR_NONE)))
    if op == "transition":
        kinds = {"2d": ("2d_to_seq", "2d_to_flat"), "1d": ("1d_to_seq", "1d_to_flat"),
                 "seq": ("seq_to_flat_mean", "seq_to_flat_first")}[layout]
        return Step(op, _opts(kind=draw(st.sampled_from(kinds))))
    return Step(op)


def _width_after(step: Step, width: int) -> int:
    return step.get("c_out") or step.get("d_out") or width


def _layout_after(step: Step, layout: str) -> str:
    if step.op == "transition":
        return str(step.get("kind")).split("_to_")[1].split("_")[0]
    return layout


@st.composite
def model_specs(draw: st.DrawFn, max_steps: int = 5) -> ModelSpec:
    """A random small model: 1 to ``max_steps`` steps on a tiny input."""
    layout = draw(st.sampled_from(("2d", "2d", "1d", "seq", "seq", "flat")))
    dtype = draw(st.sampled_from((torch.float32,) * 8 + (torch.float64,) * 2
                                 + (torch.bfloat16,)))
    train = draw(st.integers(0, 6)) == 0
    # Training-mode BatchNorm needs more than one value per channel: on "flat" that is batch.
    batch = draw(st.integers(2 if train else 1, 3))
    width = draw(st.sampled_from((4, 8)))
    size = {"2d": draw(st.sampled_from((3, 4, 5))), "1d": draw(st.sampled_from((5, 8))),
            "seq": draw(st.sampled_from((3, 6))), "flat": 1}[layout]
    steps: list[Step] = []
    cur_layout, cur_width = layout, width
    for _ in range(draw(st.integers(1, max_steps))):
        step = draw(_step(cur_layout, cur_width, allow_train_bn=batch > 1))
        steps.append(step)
        cur_layout, cur_width = _layout_after(step, cur_layout), _width_after(step, cur_width)
    outputs = draw(st.sampled_from(("tensor", "tensor", "tuple", "dict")))
    if outputs != "tensor" and not any(s.op == "tap" for s in steps):
        steps.insert(0, Step("tap"))
    return ModelSpec(layout, batch, width, size, dtype, train, tuple(steps), outputs,
                     seed=draw(st.integers(0, 2**16)))


@st.composite
def fuzz_cases(draw: st.DrawFn) -> FuzzCase:
    """A model plus a random subset of passes disabled and a capture order."""
    spec = draw(model_specs())
    disable = tuple(n for n in PASS_NAMES if draw(st.integers(0, 3)) == 0)
    capture = draw(st.sampled_from((CAPTURES[0],) * 6 + (CAPTURES[1],) * 2 + (CAPTURES[2],)))
    return FuzzCase(spec, disable, capture)
