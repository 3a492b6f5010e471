"""The library's names the command line's parsers list (passes, precisions, exporters), copied
here so that building the parsers imports no torch: ``autoopt --help`` answers at once.
``tests/test_cli.py`` checks that each copy equals the library's own."""

from __future__ import annotations

# autoopt.passes.PASS_NAMES, in the pipeline's order.
PASS_NAMES: tuple[str, ...] = (
    "remove_noops", "attention", "gelu", "fold_batchnorm", "constant_fold", "merge_linear",
    "precision", "dead_code", "onednn_conv", "packed_linear", "grouped_attention",
    "attention_window",
)
# autoopt.passes.precision.PRECISIONS.
PRECISIONS: tuple[str, ...] = ("fp32", "bf16", "fp16", "int8", "int4")
# autoopt.onnx.writer.EXPORTERS.
EXPORTERS: tuple[str, ...] = ("auto", "dynamo", "torchscript")
