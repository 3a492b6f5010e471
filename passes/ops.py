"""Which ops a pattern means, at every level a captured graph can be written in.

A graph from ``torch.export`` calls ATen overloads; one from Dynamo or ``torch.fx.symbolic_trace``
calls ``torch`` and ``torch.nn.functional`` functions, Python operators, Tensor methods
(``call_method``) and, after ``symbolic_trace``, ``nn.Module`` leaves (``call_module``). Each
:class:`OpSet` below holds one op family in all of those spellings, so passes match against
these sets instead of spelling op names themselves; :func:`autoopt.passes.graph.is_call` tests a
node against a set at any level. A pass that reads arguments in one level's layout only (ATen
schemas, say) takes that part (``OPS.aten``) and says why.

Families, in order: matmul/linear, convolution, attention, softmax, transpose/permute, norms,
activations, elementwise arithmetic, reductions and other numerically sensitive ops, views and
casts, dropout and identity, uninitialized memory, in-place writes; then the sets that name a
role (costly, sensitive, bounded) built from them.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

aten = torch.ops.aten


@dataclass(frozen=True)
class OpSet:
    """One op family as each capture level spells it.

    Attributes:
        functions: ``call_function`` targets: ATen overloads (export graphs), ``torch`` and
            ``torch.nn.functional`` functions and Python operators (Dynamo, symbolic_trace).
        methods: Tensor method names, the targets of ``call_method``.
        modules: ``nn.Module`` classes, for ``call_module``.
    """

    functions: frozenset[Any] = frozenset()
    methods: frozenset[str] = frozenset()
    modules: tuple[type[nn.Module], ...] = ()

    def __or__(self, other: OpSet) -> OpSet:
        modules = self.modules + tuple(m for m in other.modules if m not in self.modules)
        return OpSet(self.functions | other.functions, self.methods | other.methods, modules)

    @property
    def aten(self) -> frozenset[Any]:
        """The ATen overloads (and overload packets) only: what an export graph calls."""
        return frozenset(f for f in self.functions
                         if isinstance(f, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)))


def _ops(*functions: Any, methods: Iterable[str] = (),
         modules: Iterable[type[nn.Module]] = ()) -> OpSet:
    return OpSet(frozenset(functions), frozenset(methods), tuple(modules))


def _union(*sets: OpSet) -> OpSet:
    result = OpSet()
    for s in sets:
        result = result | s
    return result


# ── matmul / linear ──────────────────────────────────────────────────────────────────────────
# `a @ b`: broadcasting batched matmul. Hand-written attention is written with it.
MATMUL = _ops(aten.matmul.default, torch.matmul, operator.matmul,
              methods=("matmul", "__matmul__"))
MM = _ops(aten.mm.default, torch.mm, methods=("mm",))
BMM = _ops(aten.bmm.default, torch.bmm, methods=("bmm",))
ADDMM = _ops(aten.addmm.default, torch.addmm, methods=("addmm",))
BADDBMM = _ops(aten.baddbmm.default, torch.baddbmm, methods=("baddbmm",))
EINSUM = _ops(aten.einsum.default, torch.einsum)
LINEAR = _ops(aten.linear.default, F.linear, modules=(nn.Linear,))
MATMULS = _union(MATMUL, MM, BMM, ADDMM, BADDBMM, EINSUM, LINEAR)

# ── convolution ──────────────────────────────────────────────────────────────────────────────
# The output channels of the weight are the channels of the result (what a BatchNorm after it
# normalizes). `aten.convolution` is transposed when its `transposed` flag is.
CONV2D = _ops(aten.conv2d.default, aten.conv2d.padding, F.conv2d, torch.conv2d,
              modules=(nn.Conv2d,))
CONV = CONV2D | _ops(
    aten.conv1d.default, aten.conv3d.default, aten.conv1d.padding, aten.conv3d.padding,
    aten.convolution.default, F.conv1d, F.conv3d, torch.conv1d, torch.conv3d,
    modules=(nn.Conv1d, nn.Conv2d, nn.Conv3d))
CONV_TRANSPOSE = _ops(
    aten.conv_transpose1d.default, aten.conv_transpose2d.input, aten.conv_transpose3d.input,
    F.conv_transpose1d, F.conv_transpose2d, F.conv_transpose3d,
    modules=(nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d))

# ── attention ────────────────────────────────────────────────────────────────────────────────
ATTENTION = _ops(aten.scaled_dot_product_attention.default, F.scaled_dot_product_attention)
# The kernels `scaled_dot_product_attention` dispatches to: what a decomposed graph calls and
# what autograd records below the graph level.
ATTENTION_KERNELS = _ops(
    aten._scaled_dot_product_flash_attention_for_cpu.default,
    aten._scaled_dot_product_flash_attention.default,
    aten._scaled_dot_product_efficient_attention.default,
    aten._scaled_dot_product_cudnn_attention.default)
# Attention with an additive mask argument, as (position, keyword). The mask's magnitude does not
# reach the output (a weighted mean of the values), so a huge mask value is a mask, not an
# overflow to carry on.
ATTENTION_MASK_ARG: dict[Any, tuple[int, str]] = dict.fromkeys(ATTENTION.functions,
                                                               (3, "attn_mask"))

# ── softmax ──────────────────────────────────────────────────────────────────────────────────
SOFTMAX = _ops(aten.softmax.int, aten._softmax.default, torch.softmax, F.softmax,
               methods=("softmax",), modules=(nn.Softmax,))
LOG_SOFTMAX = _ops(aten.log_softmax.int, aten._log_softmax.default, torch.log_softmax,
                   F.log_softmax, methods=("log_softmax",), modules=(nn.LogSoftmax,))

# ── transpose / permute ──────────────────────────────────────────────────────────────────────
TRANSPOSE = _ops(aten.transpose.int, torch.transpose, methods=("transpose",))
PERMUTE = _ops(aten.permute.default, torch.permute, methods=("permute",))

# ── norms ────────────────────────────────────────────────────────────────────────────────────
# BatchNorm with running statistics: a per-channel affine map when not training. The tuple
# variants return (output, save_mean, save_invstd).
BATCH_NORM = _ops(
    aten.batch_norm.default, aten.native_batch_norm.default,
    aten._native_batch_norm_legit_no_training.default, F.batch_norm, torch.batch_norm,
    modules=(nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d))
INSTANCE_NORM = _ops(aten.instance_norm.default, F.instance_norm, torch.instance_norm,
                     modules=(nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d))
LAYER_NORM = _ops(aten.layer_norm.default, aten.native_layer_norm.default, F.layer_norm,
                  torch.layer_norm, modules=(nn.LayerNorm,))
GROUP_NORM = _ops(aten.group_norm.default, aten.native_group_norm.default, F.group_norm,
                  torch.group_norm, modules=(nn.GroupNorm,))
RMS_NORM = _ops(aten.rms_norm.default, F.rms_norm, torch.rms_norm, modules=(nn.RMSNorm,))
NORMS = _union(BATCH_NORM, INSTANCE_NORM, LAYER_NORM, GROUP_NORM, RMS_NORM)
# Normalizations that update their running statistics in place when computing batch statistics
# (`training` / `use_input_stats`), although neither the functions nor these ATen schemas say so
# (`native_batch_norm`'s schema does, so it is not here).
STATISTICS_UPDATING = _ops(F.batch_norm, torch.batch_norm, aten.batch_norm.default,
                           F.instance_norm, torch.instance_norm, aten.instance_norm.default)

# ── activations ──────────────────────────────────────────────────────────────────────────────
# Each with its in-place twin (`relu_`): the same values, written into the input.
RELU = _ops(aten.relu.default, aten.relu_.default, torch.relu, torch.relu_, F.relu, F.relu_,
            methods=("relu", "relu_"), modules=(nn.ReLU,))
RELU6 = _ops(aten.relu6.default, *([aten.relu6_.default] if hasattr(aten, "relu6_") else []),
             F.relu6, modules=(nn.ReLU6,))
HARDTANH = _ops(aten.hardtanh.default, aten.hardtanh_.default, F.hardtanh, F.hardtanh_,
                modules=(nn.Hardtanh,))
LEAKY_RELU = _ops(aten.leaky_relu.default, aten.leaky_relu_.default, F.leaky_relu,
                  F.leaky_relu_, modules=(nn.LeakyReLU,))
SIGMOID = _ops(aten.sigmoid.default, aten.sigmoid_.default, torch.sigmoid, torch.sigmoid_,
               F.sigmoid, methods=("sigmoid", "sigmoid_"), modules=(nn.Sigmoid,))
TANH = _ops(aten.tanh.default, aten.tanh_.default, torch.tanh, torch.tanh_, F.tanh,
            methods=("tanh", "tanh_"), modules=(nn.Tanh,))
SILU = _ops(aten.silu.default, aten.silu_.default, F.silu, modules=(nn.SiLU,))
GELU = _ops(aten.gelu.default, aten.gelu_.default, F.gelu, modules=(nn.GELU,))
HARDSWISH = _ops(aten.hardswish.default, aten.hardswish_.default, F.hardswish,
                 modules=(nn.Hardswish,))
HARDSIGMOID = _ops(aten.hardsigmoid.default, aten.hardsigmoid_.default, F.hardsigmoid,
                   modules=(nn.Hardsigmoid,))
# Pieces of a GELU written out by hand.
ERF = _ops(aten.erf.default, torch.erf, torch.special.erf, methods=("erf",))

# ── elementwise arithmetic ───────────────────────────────────────────────────────────────────
# Out of place: `x * 1`, `x / 1`, `x + 0` and `x - 0` make a new tensor equal to x. Keyword
# arguments (`alpha`, `rounding_mode`) change what they compute, so matchers check them.
MULTIPLY = _ops(aten.mul.Tensor, aten.mul.Scalar, operator.mul, torch.mul,
                methods=("mul", "multiply", "__mul__", "__rmul__"))
DIVIDE = _ops(aten.div.Tensor, aten.div.Scalar, operator.truediv, torch.div,
              methods=("div", "divide", "true_divide", "__truediv__"))
ADD = _ops(aten.add.Tensor, aten.add.Scalar, operator.add, torch.add,
           methods=("add", "__add__", "__radd__"))
SUBTRACT = _ops(aten.sub.Tensor, aten.sub.Scalar, operator.sub, torch.sub,
                methods=("sub", "subtract", "__sub__"))
BINARY_ARITHMETIC = _union(MULTIPLY, DIVIDE, ADD, SUBTRACT)
# `x += y` into x's own memory (a residual add a convolution kernel can write in place).
ADD_INPLACE = _ops(aten.add_.Tensor, aten.add_.Scalar, operator.iadd,
                   methods=("add_", "__iadd__"))
POW = _ops(aten.pow.Tensor_Scalar, aten.pow.Tensor_Tensor, aten.pow.Scalar, torch.pow,
           operator.pow, methods=("pow", "__pow__"))

# ── reductions and other numerically sensitive ops ───────────────────────────────────────────
# Long sums: each adds many terms, so a short mantissa loses the small ones.
REDUCTIONS = _ops(
    aten.sum.default, aten.sum.dim_IntList, aten.mean.default, aten.mean.dim, aten.var.default,
    aten.var.dim, aten.var.correction, aten.std.default, aten.std.dim, aten.std.correction,
    aten.var_mean.correction, aten.norm.Scalar, aten.norm.ScalarOpt_dim,
    aten.linalg_vector_norm.default, aten.prod.default, aten.prod.dim_int,
    aten.logsumexp.default,
    torch.sum, torch.mean, torch.var, torch.std, torch.var_mean, torch.norm,
    torch.linalg.vector_norm, torch.prod, torch.logsumexp,
    methods=("sum", "mean", "var", "std", "norm", "prod", "logsumexp"))
# Exponentials and logarithms: they amplify relative error.
EXP_LOG = _ops(
    aten.exp.default, aten.log.default, aten.log1p.default, aten.expm1.default,
    aten.log2.default, aten.reciprocal.default, aten.rsqrt.default,
    torch.exp, torch.log, torch.log1p, torch.expm1, torch.log2, torch.reciprocal, torch.rsqrt,
    methods=("exp", "log", "log1p", "expm1", "log2", "reciprocal", "rsqrt"))
LOSSES = _ops(
    aten.cross_entropy_loss.default, aten.nll_loss.default, aten.nll_loss_nd.default,
    aten.mse_loss.default, aten.l1_loss.default, aten.smooth_l1_loss.default,
    aten.huber_loss.default, aten.binary_cross_entropy.default,
    aten.binary_cross_entropy_with_logits.default, aten.kl_div.default,
    F.cross_entropy, F.nll_loss, F.mse_loss, F.l1_loss, F.smooth_l1_loss, F.huber_loss,
    F.binary_cross_entropy, F.binary_cross_entropy_with_logits, F.kl_div,
    modules=(nn.CrossEntropyLoss, nn.NLLLoss, nn.MSELoss, nn.L1Loss, nn.SmoothL1Loss,
             nn.HuberLoss, nn.BCELoss, nn.BCEWithLogitsLoss, nn.KLDivLoss))
CUMULATIVE = _ops(aten.cumsum.default, aten.cumprod.default, aten.logcumsumexp.default,
                  torch.cumsum, torch.cumprod, torch.logcumsumexp,
                  methods=("cumsum", "cumprod", "logcumsumexp"))

# ── views and casts ──────────────────────────────────────────────────────────────────────────
# Ops that return their input itself (an alias) when nothing about it changes.
TO = _ops(aten.to.dtype, aten.to.device, aten.to.dtype_layout, aten.to.other, methods=("to",))
CONTIGUOUS = _ops(aten.contiguous.default, methods=("contiguous",))
RESHAPE = _ops(aten.view.default, aten.reshape.default, aten._unsafe_view.default,
               torch.reshape, methods=("view", "reshape"))
EXPAND = _ops(aten.expand.default, methods=("expand",))
SLICE = _ops(aten.slice.Tensor)
# Export's runtime checks of a tensor's dtype/device/layout, provable from metadata.
ASSERT_METADATA = _ops(aten._assert_tensor_metadata.default)

# ── dropout and identity ─────────────────────────────────────────────────────────────────────
# Random zeroing, which is the identity when not training (or p == 0).
DROPOUT = _ops(
    aten.dropout.default, F.dropout, torch.dropout, F.dropout1d, F.dropout2d, F.dropout3d,
    F.alpha_dropout, F.feature_alpha_dropout, torch.alpha_dropout, torch.feature_dropout,
    modules=(nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout,
             nn.FeatureAlphaDropout))
IDENTITY = _ops(modules=(nn.Identity,))

# ── uninitialized memory ─────────────────────────────────────────────────────────────────────
# Ops whose result is not a function of their arguments. (Random ops carry
# `torch.Tag.nondeterministic_seeded` in their schema, so they need no list.) Overload packets.
UNINITIALIZED = _ops(aten.empty, aten.empty_like, aten.empty_strided, aten.empty_permuted,
                     aten.new_empty, aten.new_empty_strided, torch.empty, torch.empty_like,
                     torch.empty_strided, methods=("new_empty", "new_empty_strided"))

# ── in-place writes ──────────────────────────────────────────────────────────────────────────
# Python operators that write to their first argument: `x[i] = v` and `x += y` in Dynamo graphs,
# and the same operators called as tensor methods (`call_method __iadd__`). Named in-place ops
# (`add_`, `relu_`) follow PyTorch's trailing-underscore convention and need no list.
_INPLACE_OPERATORS = (
    operator.setitem, operator.delitem, operator.iadd, operator.isub, operator.imul,
    operator.itruediv, operator.ifloordiv, operator.imod, operator.ipow, operator.imatmul,
    operator.iand, operator.ior, operator.ixor, operator.ilshift, operator.irshift)
INPLACE_OPERATORS = _ops(*_INPLACE_OPERATORS,
                         methods=(f"__{op.__name__}__" for op in _INPLACE_OPERATORS))

# ── roles ────────────────────────────────────────────────────────────────────────────────────
# Costly ops: matmuls, convolutions and attention, at graph level. Where fp16/bf16 tensor cores
# and AMX earn their speed (their accumulation is in fp32 inside the kernel anyway), and whose
# results are the most expensive to compute again per byte they make, so a selective recompute
# keeps them.
COSTLY = _union(MATMULS, CONV, CONV_TRANSPOSE, ATTENTION)
# The same ops as the kernels autograd records them under (linear and matmul run as
# addmm/mm/bmm, every convolution as `aten.convolution`, attention as one of its backends):
# what a checkpoint policy sees, below the graph level, when it decides what to keep.
COSTLY_KERNELS = _union(MM, BMM, ADDMM, BADDBMM, ATTENTION_KERNELS) | _ops(
    aten.convolution.default)

# Ops whose result loses too much with a 7- or 10-bit mantissa: normalizations divide by a
# variance, softmax, exp/log and pow amplify relative error, long reductions and cumulative ops
# sum many terms, and losses feed every gradient.
SENSITIVE = _union(SOFTMAX, LOG_SOFTMAX, NORMS, REDUCTIONS, EXP_LOG, POW, LOSSES, CUMULATIVE)

# Ops whose result stays bounded whatever the magnitude of their inputs (probabilities,
# normalized values): a mask value near fp32's limits that enters them does not leave. Only the
# forms with one output: `native_layer_norm` and `native_group_norm` also return the mean,
# which is not bounded.
BOUNDED = SOFTMAX | _ops(
    aten.sigmoid.default, aten.tanh.default, aten.layer_norm.default, aten.rms_norm.default,
    aten.group_norm.default, torch.sigmoid, torch.tanh, F.sigmoid, F.tanh, F.layer_norm,
    F.rms_norm, F.group_norm, methods=("sigmoid", "tanh"),
    modules=(nn.Sigmoid, nn.Tanh, nn.LayerNorm, nn.RMSNorm, nn.GroupNorm))
