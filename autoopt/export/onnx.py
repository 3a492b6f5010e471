"""``export_onnx``: write the graph autoopt optimized as an ONNX file and check it.

    report = autoopt.export_onnx(model, (x,), "model.onnx", dynamic=("batch",))
    session = autoopt.onnx_session("model.onnx")       # a callable on torch tensors
    y = session(x)

``export_onnx`` writes the graph ``optimize`` built (after autoopt's passes), checks it with
``onnx.checker``, runs it under ONNX Runtime and compares it with eager PyTorch. The steps:

1. optimize the model for inference (a given ``OptimizedModule`` is used as it is) and take the
   whole graph it runs for the example inputs; a partial (Dynamo) capture cannot be exported;
2. export that graph with ``torch.onnx.export(dynamo=True)`` (``torch.export`` + onnxscript),
   else with the TorchScript exporter, recording why;
3. ``onnx.checker``; count nodes by op type in the file and in the model ORT optimizes;
4. compare ORT with eager on the example inputs, fresh random ones and, when dynamic, inputs
   whose dynamic dimensions are one larger.

This module is that flow, its report and its verification; names and dynamic dimensions are
``onnx_io``'s, the exporters ``onnx_writer``'s, the ONNX Runtime session ``session``'s.

onnx and onnxruntime are imported inside the functions: ``import autoopt`` stays fast.
"""

from __future__ import annotations

import contextlib
import logging
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.fx import GraphModule
from torch.utils import _pytree as pytree

from autoopt.capture import objects
from autoopt.check.compare import Tolerance, VerifyResult, check_all, reference_run
from autoopt.check.inputs import input_sets, leaves
from autoopt.errors import AutoOptError, ConfigError, ModelError, ModelSpecError, require
from autoopt.observe import progress
from autoopt.onnx.session import OnnxSession, onnx_session
from autoopt.onnx.signature import (
    check_dims_apply,
    check_dynamic,
    check_optimized,
    check_path,
    dims_of,
    dynamic_shapes,
    flat_tensors,
    in_forward_order,
    name_inputs,
    name_outputs,
)
from autoopt.onnx.writer import (
    EXPORTERS,
    count_nodes,
    first_line,
    graph_shapes,
    opset_of,
    weight_bytes,
    write_onnx,
)
from autoopt.options import precision as precision_lib
from autoopt.passes.graph import portable

log = logging.getLogger(__name__)


# Protobuf cannot serialize a message over 2 GiB, so bigger weights go to a side file.
_PROTOBUF_LIMIT = 2**31


@dataclass
class OnnxReport:
    """What ``export_onnx`` did.

    Args:
        path: the ``.onnx`` file written.
        exporter: ``dynamo`` (``torch.export`` + onnxscript) or ``torchscript``.
        opset: the ONNX opset of the default domain.
        fallback_reason: why the dynamo exporter was not used (empty when it was).
        capture_method: how autoopt captured the graph that was exported.
        inputs: ``name -> shape`` as written in the file (``batch`` for a dynamic dimension).
        outputs: output names, in order.
        external_data: whether the weights went to ``<path>.data``.
        nodes_before: ONNX nodes by op type, as exported.
        nodes_after: nodes by op type after ORT's graph optimizations (ORT_ENABLE_ALL, CPU);
            empty when ORT could not load the file.
        ort_error: why ONNX Runtime could not load the file (``verify=False`` only: with
            verification that is a ``ConfigError``); empty when it could.
        verification: ORT against eager on the example and fresh random inputs.
        dynamic_verification: the same at dynamic dimensions one larger (when dynamic).
        seconds: wall time of the whole export, checks included.
    """

    path: str
    exporter: str
    opset: int
    fallback_reason: str = ""
    capture_method: str = ""
    inputs: dict[str, list[int | str]] = field(default_factory=dict)
    outputs: list[str] = field(default_factory=list)
    external_data: bool = False
    nodes_before: dict[str, int] = field(default_factory=dict)
    nodes_after: dict[str, int] = field(default_factory=dict)
    ort_error: str = ""
    verification: VerifyResult | None = None
    dynamic_verification: VerifyResult | None = None
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        """Every comparison that ran matched."""
        return all(v.ok for v in (self.verification, self.dynamic_verification) if v)

    @property
    def max_abs_error(self) -> float:
        """Largest absolute difference from eager over every comparison that ran."""
        return max((v.max_abs_error for v in (self.verification, self.dynamic_verification)
                    if v), default=0.0)

    def __str__(self) -> str:
        lines = [f"autoopt ONNX export: {self.path}",
                 f"    exporter: {self.exporter}, opset {self.opset}"
                 + (f", external data {self.path}.data" if self.external_data else "")]
        if self.fallback_reason:
            lines.append(f"    dynamo exporter not used: {self.fallback_reason}")
        lines.append(f"    graph: autoopt capture by {self.capture_method}")
        shapes = ", ".join(f"{n}[{', '.join(map(str, s))}]" for n, s in self.inputs.items())
        lines.append(f"    inputs: {shapes}")
        lines.append(f"    outputs: {', '.join(self.outputs)}")
        if self.nodes_before and self.ort_error:
            lines.append(f"    nodes: {sum(self.nodes_before.values())} exported; ONNX Runtime "
                         f"here cannot load the file: {self.ort_error}")
            lines.append(f"        exported: {_top(self.nodes_before)}")
        elif self.nodes_before:
            lines.append(f"    nodes: {sum(self.nodes_before.values())} exported -> "
                         f"{sum(self.nodes_after.values())} after ORT optimizations")
            lines.append(f"        exported: {_top(self.nodes_before)}")
            lines.append(f"        ORT:      {_top(self.nodes_after)}")
        if self.verification is not None:
            lines.append(f"    verification (ORT vs eager): {self.verification}")
        if self.dynamic_verification is not None:
            lines.append(f"    at larger dynamic dims: {self.dynamic_verification}")
        if self.verification is None:
            lines.append("    verification: skipped")
        lines.append(f"    time: {self.seconds:.2f} s")
        return "\n".join(lines)


def _top(counts: Mapping[str, int], n: int = 8) -> str:
    ranked = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
    text = ", ".join(f"{op} {c}" for op, c in ranked[:n])
    return text + (f", ... ({len(ranked) - n} more types)" if len(ranked) > n else "")


class OnnxVerificationError(AutoOptError, RuntimeError):
    """The exported ONNX model does not compute what the PyTorch model computes.

    The file is left in place for inspection; ``report`` says where and by how much.
    """

    def __init__(self, message: str, report: OnnxReport) -> None:
        super().__init__(message)
        self.report = report


@progress.reporting("export_onnx")
def export_onnx(model_or_optimized: nn.Module, example_inputs: Any, path: str | Path, *,
                example_kwargs: Mapping[str, Any] | None = None,
                dynamic: str | Sequence[str] = (), opset: int | None = None,
                verify: bool = True, random_inputs: int = 2,
                tolerances: Mapping[torch.dtype, Tolerance] | None = None,
                exporter: str = "auto", config: Any = None,
                precision: str | None = None) -> OnnxReport:
    """Export the graph autoopt optimized to ONNX and check it under ONNX Runtime.

    Args:
        model_or_optimized: an ``nn.Module`` (optimized first, for inference) or the
            ``OptimizedModule`` that ``autoopt.optimize`` returned.
        example_inputs: positional inputs, as a tuple (a single tensor is accepted).
        path: the ``.onnx`` file to write (weights over 2 GB go to ``<path>.data``).
        example_kwargs: keyword inputs; ONNX inputs are named after the forward's arguments.
        dynamic: dimensions to leave symbolic, from ``DYNAMIC_DIMS``: ``"batch"`` is dim 0 of
            every tensor input, ``"sequence"`` dim 1 of every integer/bool input. The example
            must have a size of at least 2 there (export specializes a size of 1).
        opset: ONNX opset version; default: the exporter's.
        verify: compare ORT with eager; a mismatch raises ``OnnxVerificationError``.
        random_inputs: fresh random input sets to verify on, besides the examples.
        tolerances: per-dtype ``Tolerance`` overrides for verification.
        exporter: ``"auto"`` (dynamo, then TorchScript), ``"dynamo"`` or ``"torchscript"``.
        config: an ``OptimizeConfig`` or dict for the optimize step (plain modules only).
        precision: ``"fp16"`` (or ``"bf16"``) for plain modules: the graph carries the precision
            pass's casts (low-precision compute, fp32 islands; inputs and outputs keep their
            types) and is verified within the precision's tolerance.

    Returns:
        An ``OnnxReport``; ``print`` it to read it.

    Example:
        >>> report = autoopt.export_onnx(resnet, (x,), "resnet.onnx", dynamic="batch")
        >>> print(report)
    """
    from autoopt.module.build import build as optimize
    from autoopt.module.build import check_inputs
    from autoopt.module.optimized import OptimizedModule

    start = time.perf_counter()
    onnx = require("onnx", "ONNX export", "pip install onnx onnxscript")
    require("onnxruntime", "ONNX export (verification and ORT's node counts)",
            "pip install onnxruntime")
    path = check_path(path)
    dims = check_dynamic(dynamic)
    if exporter not in EXPORTERS:
        raise ConfigError(f"exporter={exporter!r}; use one of {EXPORTERS}")
    if precision == "int8":
        raise ConfigError(_INT8_MESSAGE)
    args, kwargs = check_inputs(example_inputs, example_kwargs)
    check_dims_apply(dims, args, kwargs)
    if isinstance(model_or_optimized, OptimizedModule):
        optimized = model_or_optimized
        check_optimized(optimized, dims, precision, config)
        kwargs = in_forward_order(optimized.module.forward, kwargs)
    elif isinstance(model_or_optimized, nn.Module):
        kwargs = in_forward_order(model_or_optimized.forward, kwargs)
        with eval_mode(model_or_optimized):
            shapes = dynamic_shapes(model_or_optimized.forward, args, kwargs, dims)
            optimized = optimize(model_or_optimized, args, kwargs,
                                 config=_file_config(config, precision),
                                 dynamic_shapes=shapes, training=False)
    else:
        raise ModelError(f"export_onnx expects an nn.Module or an OptimizedModule; got "
                         f"{type(model_or_optimized).__name__}.")
    eager = optimized.module
    if tolerances is None and optimized.config.low_precision:
        tolerances = optimized.config.verification_tolerances  # the precision's end-to-end
    with torch.no_grad():
        expected = eager(*args, **kwargs)
        gm, method = _whole_graph(optimized, args, kwargs)
    if _quantized_ops(gm):
        raise ConfigError(_INT8_MESSAGE)
    # The graph takes the keywords in the order they were captured in; the exporter, given
    # them in another, named each ONNX input after another's tensor. The file's inputs are in
    # the graph's order (for a module optimized here, the forward's).
    kwargs = in_forward_order(gm.forward, kwargs)

    input_names = name_inputs(eager.forward, args, kwargs)
    output_names = name_outputs(expected)
    external = weight_bytes(gm) > _PROTOBUF_LIMIT
    shapes = dynamic_shapes(gm.forward, args, kwargs, dims, named=True)
    with objects.scoped_for(expected):  # a DynamicCache output (see capture.objects)
        used, fallback = write_onnx(gm, args, kwargs, path, input_names, output_names,
                                    shapes, dims, opset, external, exporter)
    try:  # the path form also reads external data, which a >2 GB model needs
        onnx.checker.check_model(str(path))
    except onnx.checker.ValidationError as exc:
        raise ModelError(f"the {used} exporter wrote {path}, but onnx.checker rejects it: "
                         f"{first_line(exc)}") from exc
    proto = onnx.load(str(path), load_external_data=False)
    report = OnnxReport(str(path), used, opset_of(proto), fallback, method,
                        inputs=graph_shapes(proto), outputs=[o.name for o in proto.graph.output],
                        external_data=external, nodes_before=count_nodes(proto))
    with tempfile.TemporaryDirectory() as tmp:
        optimized_path = Path(tmp) / "ort_optimized.onnx"
        try:
            session = onnx_session(path, optimized_model_path=optimized_path)
        except ModelSpecError as exc:
            # The file is valid ONNX (the checker passed), but this ONNX Runtime lacks a kernel
            # for one of its ops: bf16 Gemm on the CPU provider, say. Other runtimes may have it.
            report.ort_error = first_line(exc.__cause__ or exc)
            if verify:
                raise ConfigError(
                    f"wrote {path}, but ONNX Runtime on this machine cannot load it to verify it "
                    f"({report.ort_error}). The file is kept for a runtime that has these "
                    f"kernels; pass verify=False (--no-verify) to export without the check"
                    + (", or export in fp32 or fp16" if precision == "bf16" else "")
                    + ".") from exc
        else:
            report.nodes_after = count_nodes(onnx.load(str(optimized_path),
                                                       load_external_data=False))
    if verify:
        _verify(report, session, eager, args, kwargs, input_names, dims, random_inputs,
                tolerances)
    report.seconds = time.perf_counter() - start
    log.info("%s", report)
    if not report.ok:
        failed = report.verification if not report.verification.ok else \
            report.dynamic_verification
        raise OnnxVerificationError(f"the ONNX model {path} ({used} exporter) differs from "
                                    f"eager PyTorch under ONNX Runtime: {failed.detail}",
                                    report)
    return report


# --- what to export --------------------------------------------------------------------------


_INT8_MESSAGE = (
    "precision='int8' cannot be exported to ONNX: autoopt's int8 is PyTorch dynamic "
    "quantization (quantized::linear_dynamic with packed weights), which neither ONNX exporter "
    "translates. Export in fp32 and quantize the file with ONNX Runtime "
    "(onnxruntime.quantization.quantize_dynamic), or export with precision='fp16'.")


def _file_config(config: Any, precision: str | None) -> Any:
    """The optimize config for the graph the file is written from: the user's, with the
    precision's casts made (``export_config``), and nothing the file does not hold.

    The file comes from the graph before the device-specific lowerings and before any runtime
    backend (``portable``), so the lowering passes are left out and the one backend is
    ``aten``: choosing one built and timed an Inductor compile and an ONNX Runtime session,
    80 s of a tiny BERT's 103 s export, for a choice the file never used."""
    from autoopt.options.config import OptimizeConfig
    from autoopt.passes import LOWERING

    cfg = OptimizeConfig.build(precision_lib.export_config(config, precision), {})
    disable = tuple(dict.fromkeys((*cfg.disable, *sorted(LOWERING))))
    return OptimizeConfig.build(cfg, {"backend": "aten", "backends": None, "disable": disable})


def _quantized_ops(gm: GraphModule) -> list[str]:
    return [str(n.target) for n in gm.graph.nodes
            if n.op == "call_function" and getattr(n.target, "namespace", "") == "quantized"]


@contextlib.contextmanager
def eval_mode(model: nn.Module) -> Iterator[None]:
    """ONNX files are for inference: capture in eval mode, then give each submodule its own
    mode back (a train-mode model may hold frozen eval-mode BatchNorms)."""
    modes = [(module, module.training) for module in model.modules()]
    model.eval()
    try:
        yield
    finally:
        for module, training in modes:
            module.training = training


def _whole_graph(optimized: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
                 ) -> tuple[GraphModule, str]:
    """The optimized graph module ``optimized`` runs for these inputs (as ``save_program``)."""
    specialization = optimized.specialization_for(args, kwargs)
    graph, served = specialization.graph, specialization.method
    if not isinstance(graph, GraphModule) or served != "export":
        attempts = "; ".join(f"{m}: {why}" for c in optimized.report.captures
                             for m, why in c.attempts)
        method = served
        raise ModelError(f"cannot export to ONNX: the model was captured by {method!r}, "
                         f"not as one whole graph by torch.export, so there is no single graph "
                         f"to write. Make the model exportable with torch.export "
                         f"(capture attempts: {attempts or 'none recorded'}).")
    return portable(graph), served


# --- verification ----------------------------------------------------------------------------


def _verify(report: OnnxReport, session: OnnxSession, eager: nn.Module, args: tuple[Any, ...],
            kwargs: dict[str, Any], input_names: list[str], dims: tuple[str, ...],
            random_inputs: int, tolerances: Mapping[torch.dtype, Tolerance] | None) -> None:
    """Fill ``report.verification`` (and ``dynamic_verification``) from eager vs ORT runs."""
    def run_pair(a: tuple[Any, ...], k: dict[str, Any]) -> tuple[Any, Any]:
        with torch.no_grad(), reference_run():  # eager rejecting a random set discards it
            expected = eager(*a, **k)
        tensors = [leaf for _, leaf in leaves(expected, "output")
                   if isinstance(leaf, torch.Tensor)]
        feeds = {n: t for n, t in flat_tensors(a, k, input_names).items()
                 if n in session.input_names}
        actual = session.run(feeds)
        return (dict(zip(report.outputs, tensors, strict=False)),
                {n: actual[n] for n in report.outputs})

    report.verification = check_all(run_pair, input_sets(args, kwargs, random_inputs),
                                    tolerances)
    if dims and report.verification.ok:
        # Fresh inputs whose dynamic dimensions are one larger than the example's.
        grown = _grow(args, dims), {k: _grow(v, dims) for k, v in kwargs.items()}
        sets = input_sets(*grown, max(random_inputs, 1))[1:]
        report.dynamic_verification = check_all(run_pair, sets, tolerances)


def _grow(value: Any, dims: tuple[str, ...]) -> Any:
    def grow(t: torch.Tensor) -> torch.Tensor:
        for d in dims_of(t, dims):
            t = torch.cat([t, t.narrow(d, 0, 1)], d)
        return t

    return pytree.tree_map_only(torch.Tensor, grow, value)
