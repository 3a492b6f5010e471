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
