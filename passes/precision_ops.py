"""Which ATen ops reduced precision helps, and which it hurts.

The precision pass reads these sets (``torch.export`` graphs call ATen overloads): compute-heavy
ops are the candidates to run in fp16/bf16, numerically sensitive ops always stay in fp32, and
every other op follows its inputs so that casts sit only at region boundaries.
"""

from __future__ import annotations

import torch

aten = torch.ops.aten

# Matmuls, convolutions and attention: where fp16/bf16 tensor cores and AMX earn their speed, and
# whose accumulation is in fp32 inside the kernel anyway.
COMPUTE_HEAVY = frozenset(
    {aten.linear.default, aten.matmul.default, aten.mm.default, aten.addmm.default,
     aten.bmm.default, aten.baddbmm.default, aten.einsum.default,
     aten.conv1d.default, aten.conv2d.default, aten.conv3d.default, aten.conv1d.padding,
     aten.conv2d.padding, aten.conv3d.padding, aten.convolution.default,
     aten.conv_transpose1d.default, aten.conv_transpose2d.input, aten.conv_transpose3d.input,
     aten.scaled_dot_product_attention.default}
)

# Ops whose result loses too much with a 7- or 10-bit mantissa: normalizations divide by a
# variance, softmax and exp/log amplify relative error, long reductions and cumulative ops sum
# many terms, and losses feed every gradient.
SENSITIVE = frozenset(
    {aten.softmax.int, aten._softmax.default, aten.log_softmax.int, aten._log_softmax.default,
     aten.layer_norm.default, aten.native_layer_norm.default, aten.group_norm.default,
     aten.native_group_norm.default, aten.batch_norm.default, aten.native_batch_norm.default,
     aten._native_batch_norm_legit_no_training.default, aten.instance_norm.default,
     aten.rms_norm.default,
     aten.sum.default, aten.sum.dim_IntList, aten.mean.default, aten.mean.dim,
     aten.var.default, aten.var.dim, aten.var.correction, aten.std.default, aten.std.dim,
     aten.std.correction, aten.var_mean.correction, aten.norm.Scalar, aten.norm.ScalarOpt_dim,
     aten.linalg_vector_norm.default, aten.prod.default, aten.prod.dim_int,
     aten.logsumexp.default,
     aten.exp.default, aten.log.default, aten.log1p.default, aten.expm1.default,
     aten.log2.default, aten.pow.Tensor_Scalar, aten.pow.Tensor_Tensor, aten.pow.Scalar,
     aten.reciprocal.default, aten.rsqrt.default,
     aten.cross_entropy_loss.default, aten.nll_loss.default, aten.nll_loss_nd.default,
     aten.mse_loss.default, aten.l1_loss.default, aten.smooth_l1_loss.default,
     aten.huber_loss.default, aten.binary_cross_entropy.default,
     aten.binary_cross_entropy_with_logits.default, aten.kl_div.default,
     aten.cumsum.default, aten.cumprod.default, aten.logcumsumexp.default}
)

# Linear layers dynamic int8 quantization replaces (weight quantized once, activations per call).
INT8_LINEAR = frozenset({aten.linear.default})

# Ops whose result stays bounded whatever the magnitude of their inputs (probabilities,
# normalized values): a mask value near fp32's limits that enters them does not leave.
BOUNDED = frozenset(
    {aten.softmax.int, aten._softmax.default, aten.sigmoid.default, aten.tanh.default,
     aten.layer_norm.default, aten.rms_norm.default, aten.group_norm.default}
)

# Attention with an additive mask argument: the mask's magnitude does not reach the output (a
# weighted mean of the values), so a huge mask value is a mask, not an overflow to carry on.
ATTENTION_MASK_ARG = {aten.scaled_dot_product_attention.default: (3, "attn_mask")}
