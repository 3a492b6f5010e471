"""Which ops a pattern means, at every level a captured graph can be written in.

A graph from ``torch.export`` calls ATen overloads, one from ``torch.fx.symbolic_trace`` calls
modules and ``torch.nn.functional``, one from Dynamo calls ``torch`` functions and Python
operators. Passes match against these sets instead of spelling op names themselves.
"""

from __future__ import annotations

import operator

import torch
import torch.nn.functional as F
from torch import nn

aten = torch.ops.aten

# Random zeroing, which is the identity when not training (or p == 0).
DROPOUT_FUNCTIONS = frozenset(
    {aten.dropout.default, F.dropout, torch.dropout, F.dropout1d, F.dropout2d, F.dropout3d,
     F.alpha_dropout, F.feature_alpha_dropout, torch.alpha_dropout, torch.feature_dropout}
)
DROPOUT_MODULES = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout,
                   nn.FeatureAlphaDropout)
IDENTITY_MODULES = (nn.Identity,)

# x * 1, x / 1 and x + 0, x - 0 make a new tensor equal to x (when dtype and shape do not change).
MULTIPLY = frozenset({aten.mul.Tensor, aten.mul.Scalar, operator.mul, torch.mul})
DIVIDE = frozenset({aten.div.Tensor, aten.div.Scalar, operator.truediv, torch.div})
ADD = frozenset({aten.add.Tensor, aten.add.Scalar, operator.add, torch.add})
SUBTRACT = frozenset({aten.sub.Tensor, aten.sub.Scalar, operator.sub, torch.sub})
BINARY_ARITHMETIC = MULTIPLY | DIVIDE | ADD | SUBTRACT

# Ops that return their input itself (an alias) when nothing about it changes.
TO_SAME = frozenset({aten.to.dtype, aten.to.device, aten.to.dtype_layout, aten.to.other})
CONTIGUOUS = frozenset({aten.contiguous.default})
RESHAPE = frozenset({aten.view.default, aten.reshape.default, aten._unsafe_view.default})
EXPAND = frozenset({aten.expand.default})
PERMUTE = frozenset({aten.permute.default})
SLICE = frozenset({aten.slice.Tensor})

# Export's runtime checks of a tensor's dtype/device/layout, provable from metadata.
ASSERT_METADATA = frozenset({aten._assert_tensor_metadata.default})

# Producers an eval-mode BatchNorm after them folds into: their weight's output channels are the
# channels BatchNorm normalizes. `aten.convolution` is transposed when its `transposed` flag is.
CONV_FUNCTIONS = frozenset(
    {aten.conv1d.default, aten.conv2d.default, aten.conv3d.default, aten.conv1d.padding,
     aten.conv2d.padding, aten.conv3d.padding, aten.convolution.default}
)
CONV_TRANSPOSE_FUNCTIONS = frozenset(
    {aten.conv_transpose1d.default, aten.conv_transpose2d.input, aten.conv_transpose3d.input}
)
LINEAR_FUNCTIONS = frozenset({aten.linear.default})
CONV_MODULES = (nn.Conv1d, nn.Conv2d, nn.Conv3d)
CONV_TRANSPOSE_MODULES = (nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)
LINEAR_MODULES = (nn.Linear,)

# BatchNorm with running statistics: a per-channel affine map when not training. The tuple
# variants return (output, save_mean, save_invstd).
BATCH_NORM_FUNCTIONS = frozenset(
    {aten.batch_norm.default, aten.native_batch_norm.default,
     aten._native_batch_norm_legit_no_training.default}
)
BATCH_NORM_MODULES = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)

# Ops whose result is not a function of their arguments: uninitialized memory. (Random ops carry
# `torch.Tag.nondeterministic_seeded` in their schema, so they need no list.) Overload packets.
UNINITIALIZED = frozenset(
    {aten.empty, aten.empty_like, aten.empty_strided, aten.empty_permuted, aten.new_empty,
     aten.new_empty_strided}
)

# Hand-written attention: matmul, softmax over the last dim, matmul.
MATMUL = frozenset({aten.matmul.default})
SOFTMAX = frozenset({aten.softmax.int, aten._softmax.default})
TRANSPOSE = frozenset({aten.transpose.int})

# Pieces of a GELU written out by hand.
TANH = frozenset({aten.tanh.default, torch.tanh})
ERF = frozenset({aten.erf.default, torch.erf})
POW = frozenset({aten.pow.Tensor_Scalar, torch.pow, operator.pow})

# Python operators that write to their first argument: `x[i] = v` and `x += y` in Dynamo graphs.
INPLACE_OPERATORS = frozenset(
    {operator.setitem, operator.delitem, operator.iadd, operator.isub, operator.imul,
     operator.itruediv, operator.ifloordiv, operator.imod, operator.ipow, operator.imatmul,
     operator.iand, operator.ior, operator.ixor, operator.ilshift, operator.irshift}
)
# The same operators called as tensor methods (`call_method __iadd__`).
INPLACE_DUNDER_METHODS = frozenset(f"__{op.__name__}__" for op in INPLACE_OPERATORS)

# Normalizations that update their running statistics in place when computing batch statistics
# (`training` / `use_input_stats`), although neither the functions nor the ATen schema say so.
STATISTICS_UPDATING_FUNCTIONS = frozenset(
    {F.batch_norm, torch.batch_norm, aten.batch_norm.default, F.instance_norm,
     torch.instance_norm, aten.instance_norm.default}
)
