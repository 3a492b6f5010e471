"""Graph rewrites, each a function ``GraphModule, PassContext -> PassResult``.

``PIPELINE`` is the one place that says which passes run and in what order; the user's config
turns passes off by name. The driver that runs them, checks each result and rolls back failures
lives in ``autoopt.compile.pass_runner``.
"""

from __future__ import annotations

from .attention import replace_attention
from .attention_window import attention_window
from .base import PassContext, PassFn, PassResult
from .constant_fold import constant_fold
from .dead_code import eliminate_dead_code
from .fold_batchnorm import fold_batchnorm
from .gelu import replace_gelu
from .grouped_attention import grouped_attention
from .merge_linear import merge_linear
from .onednn_conv import onednn_conv
from .packed_linear import packed_linear
from .precision import cast_precision
from .remove_noops import remove_noops

PIPELINE: tuple[tuple[str, PassFn], ...] = (
    # Drop ops that compute nothing (eval dropout, x*1, identity views) so later patterns see
    # the real producer-consumer pairs.
    ("remove_noops", remove_noops),
    # Hand-written softmax(q k^T * s + mask) v into one fused attention kernel.
    ("attention", replace_attention),
    # A GELU spelled out in eight elementwise ops into the one fused kernel.
    ("gelu", replace_gelu),
    # Eval BatchNorm into the conv/linear before it (one op and one activation pass fewer).
    ("fold_batchnorm", fold_batchnorm),
    # Compute once what depends on no input: weight transposes and casts, position ids.
    ("constant_fold", constant_fold),
    # Sibling linears on one input (Q/K/V, gate/up) into one wide matmul, where measured faster.
    ("merge_linear", merge_linear),
    # fp16/bf16 casts around matmuls, convs and attention (or int8 linears), fp32 kept where
    # measurement says accuracy needs it. After the fusions, so it casts the fused ops; does
    # nothing unless the config sets precision=.
    ("precision", cast_precision),
    # Erase what the rewrites above left without users.
    ("dead_code", eliminate_dead_code),
    # Lowering: from here on the graph calls device-specific kernels.
    # Convolutions (+ activation / residual add) onto oneDNN with weights packed once (CPU).
    ("onednn_conv", onednn_conv),
    # fp32 linears onto MKL's GEMM with weights packed once (CPU), where measured faster.
    ("packed_linear", packed_linear),
    # Grouped-query attention on the shared key/value heads instead of copies repeated per
    # query head (transformers' repeat_kv), where measured faster.
    ("grouped_attention", grouped_attention),
    # Attention over a static cache's filled positions only, read from the mask at each call
    # (CPU decode steps).
    ("attention_window", attention_window),
)

# Passes that swap in kernels of one device and library build (opaque packed weights, mkldnn
# ops): what they make runs only here, so exports (ONNX, .pt2) take the graph from before them.
LOWERING: frozenset[str] = frozenset({"onednn_conv", "packed_linear", "grouped_attention",
                                     "attention_window"})

PASS_NAMES: tuple[str, ...] = tuple(name for name, _ in PIPELINE)

__all__ = ["LOWERING", "PIPELINE", "PASS_NAMES", "PassContext", "PassFn", "PassResult",
           "attention_window", "cast_precision", "constant_fold", "eliminate_dead_code",
           "fold_batchnorm", "grouped_attention", "merge_linear", "onednn_conv",
           "packed_linear", "remove_noops", "replace_attention", "replace_gelu"]
