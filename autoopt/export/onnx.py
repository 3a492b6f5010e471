"""ONNX emission and ONNX Runtime deployment.

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

onnx and onnxruntime are imported inside the functions: ``import autoopt`` stays fast.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import io
import logging
import re
import tempfile
import time
import warnings
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.fx import GraphModule
from torch.utils import _pytree as pytree

from .. import precision as precision_lib
from ..capture.graph import dynamic_shapes_for
from ..driver import portable
from ..errors import (
    ArgumentError,
    AutoOptError,
    ConfigError,
    DeviceError,
    InputError,
    ModelError,
    ModelSpecError,
    require,
)
from ..verify import Tolerance, VerifyResult, _leaves, check_all, input_sets

log = logging.getLogger(__name__)

# The dimensions ``dynamic=`` can name, and which input dimension each one is:
#   "batch"     dim 0 of every tensor input with at least one dimension;
#   "sequence"  dim 1 of every integer or bool tensor input with at least two (token ids,
#               attention masks). Float inputs are left alone: dim 1 of an image is channels.
DYNAMIC_DIMS = ("batch", "sequence")
EXPORTERS = ("auto", "dynamo", "torchscript")
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
    from ..build import build as optimize
    from ..build import check_inputs
    from ..module import OptimizedModule

    start = time.perf_counter()
    onnx = require("onnx", "ONNX export", "pip install onnx onnxscript")
    require("onnxruntime", "ONNX export (verification and ORT's node counts)",
            "pip install onnxruntime")
    path = _check_path(path)
    dims = _check_dynamic(dynamic)
    if exporter not in EXPORTERS:
        raise ConfigError(f"exporter={exporter!r}; use one of {EXPORTERS}")
    if precision == "int8":
        raise ConfigError(_INT8_MESSAGE)
    args, kwargs = check_inputs(example_inputs, example_kwargs)
    _check_dims_apply(dims, args, kwargs)
    if isinstance(model_or_optimized, OptimizedModule):
        optimized = model_or_optimized
        _check_optimized(optimized, dims, precision, config)
        kwargs = _in_forward_order(optimized.module.forward, kwargs)
    elif isinstance(model_or_optimized, nn.Module):
        kwargs = _in_forward_order(model_or_optimized.forward, kwargs)
        with eval_mode(model_or_optimized):
            shapes = _dynamic_shapes(model_or_optimized.forward, args, kwargs, dims)
            optimized = optimize(model_or_optimized, args, kwargs,
                                 config=precision_lib.export_config(config, precision),
                                 dynamic_shapes=shapes, training=False)
    else:
        raise ModelError(f"export_onnx expects an nn.Module or an OptimizedModule; got "
                         f"{type(model_or_optimized).__name__}.")
    eager = optimized.module
    if tolerances is None and optimized.config.low_precision:
        tolerances = optimized.config.verification_tolerances  # the precision's end-to-end
    with torch.no_grad():
        expected = eager(*args, **kwargs)
        gm, method = _whole_graph(optimized, args, kwargs, expected)
    if _quantized_ops(gm):
        raise ConfigError(_INT8_MESSAGE)

    input_names = _input_names(eager.forward, args, kwargs)
    output_names = _output_names(expected)
    external = _weight_bytes(gm) > _PROTOBUF_LIMIT
    shapes = _dynamic_shapes(gm.forward, args, kwargs, dims, named=True)
    used, fallback = _export(gm, args, kwargs, path, input_names, output_names, shapes,
                             dims, opset, external, exporter)
    try:  # the path form also reads external data, which a >2 GB model needs
        onnx.checker.check_model(str(path))
    except onnx.checker.ValidationError as exc:
        raise ModelError(f"the {used} exporter wrote {path}, but onnx.checker rejects it: "
                         f"{_first_line(exc)}") from exc
    proto = onnx.load(str(path), load_external_data=False)
    report = OnnxReport(str(path), used, _opset(proto), fallback, method,
                        inputs=_graph_shapes(proto), outputs=[o.name for o in proto.graph.output],
                        external_data=external, nodes_before=_count_nodes(proto))
    with tempfile.TemporaryDirectory() as tmp:
        optimized_path = Path(tmp) / "ort_optimized.onnx"
        try:
            session = onnx_session(path, optimized_model_path=optimized_path)
        except ModelSpecError as exc:
            # The file is valid ONNX (the checker passed), but this ONNX Runtime lacks a kernel
            # for one of its ops: bf16 Gemm on the CPU provider, say. Other runtimes may have it.
            report.ort_error = _first_line(exc.__cause__ or exc)
            if verify:
                raise ConfigError(
                    f"wrote {path}, but ONNX Runtime on this machine cannot load it to verify it "
                    f"({report.ort_error}). The file is kept for a runtime that has these "
                    f"kernels; pass verify=False (--no-verify) to export without the check"
                    + (", or export in fp32 or fp16" if precision == "bf16" else "")
                    + ".") from exc
        else:
            report.nodes_after = _count_nodes(onnx.load(str(optimized_path),
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


def _check_path(path: str | Path) -> Path:
    path = Path(path)
    if path.is_dir():
        raise ConfigError(f"path {str(path)!r} is a directory; give a file name such as "
                          f"{str(path / 'model.onnx')!r}")
    if not path.parent.is_dir():
        raise ConfigError(f"cannot write {str(path)!r}: directory {str(path.parent)!r} does "
                          "not exist")
    check_writable(path, f"path {str(path)!r}")
    return path


def check_writable(path: Path, what: str) -> None:
    """Raise ``ConfigError`` now if ``path`` cannot be written, rather than after the work.

    Opening is the only reliable test (``os.access`` says yes to root in ``/proc``); append mode
    leaves an existing file as it is, and a file made by the test is removed again.
    """
    existed = path.exists()
    try:
        with open(path, "ab"):
            pass
    except OSError as exc:
        raise ConfigError(f"{what}: cannot write there ({exc.strerror or exc}); choose a "
                          f"writable path.") from exc
    if not existed:
        path.unlink(missing_ok=True)


def _check_optimized(optimized: Any, dims: tuple[str, ...], precision: str | None,
                     config: Any) -> None:
    """An ``OptimizedModule`` is exported as it was built: refuse options it cannot honour."""
    if dims and not optimized.is_dynamic:
        raise ConfigError(f"dynamic={dims} but this OptimizedModule was built for static "
                          "shapes; pass the nn.Module itself, or optimize it with "
                          "dynamic=True.")
    built = optimized.config.precision
    if precision is not None and precision != (built or "fp32"):
        raise ConfigError(f"precision={precision!r}, but this OptimizedModule was optimized "
                          f"with precision={built!r} and is exported as it is; pass the "
                          f"nn.Module itself, or optimize it with precision={precision!r}.")
    if config is not None:
        raise ConfigError("config= sets how export_onnx optimizes a plain nn.Module; this "
                          "OptimizedModule is exported as it was built. Pass the nn.Module "
                          "itself, or optimize it with that config.")


def _in_forward_order(forward: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
    """``kwargs`` in ``forward``'s parameter order (names it does not list last, as given).

    The exporters order ONNX inputs as the keywords were given, and the session takes
    positional inputs in the file's order: this makes that order the model's own.
    """
    try:
        order = list(inspect.signature(forward).parameters)
    except (TypeError, ValueError):
        return kwargs
    rank = {name: i for i, name in enumerate(order)}
    return dict(sorted(kwargs.items(), key=lambda kv: rank.get(kv[0], len(order))))


def _check_dims_apply(dims: tuple[str, ...], args: tuple[Any, ...],
                      kwargs: Mapping[str, Any]) -> None:
    """Each dimension ``dynamic=`` names must exist on some input; else the file would be
    static while the report says it is dynamic."""
    tensors = [x for x in pytree.tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)]
    for dim in dims:
        if not any(dim in _dims_of(t, (dim,)).values() for t in tensors):
            rule = ("dim 0 of a tensor input" if dim == "batch" else
                    "dim 1 of an integer or bool input with at least two dimensions "
                    "(token ids, masks)")
            shapes = ", ".join(f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)}"
                               for t in tensors) or "none"
            raise ConfigError(f"dynamic={dim!r} means {rule}, and no example input has one "
                              f"(tensor inputs: {shapes}); leave {dim!r} out.")


def _quantized_ops(gm: GraphModule) -> list[str]:
    return [str(n.target) for n in gm.graph.nodes
            if n.op == "call_function" and getattr(n.target, "namespace", "") == "quantized"]


def _check_dynamic(dynamic: str | Sequence[str]) -> tuple[str, ...]:
    dims = (dynamic,) if isinstance(dynamic, str) else tuple(dynamic)
    unknown = [d for d in dims if d not in DYNAMIC_DIMS]
    if unknown:
        raise ConfigError(f"dynamic={dims}: unknown dimension(s) {unknown}; use a subset of "
                          f"{DYNAMIC_DIMS}")
    return dims


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


def _dims_of(value: torch.Tensor, dims: tuple[str, ...]) -> dict[int, str]:
    """The input dimensions ``dims`` name on this tensor (see ``DYNAMIC_DIMS``)."""
    out = {}
    if "batch" in dims and value.dim() >= 1:
        out[0] = "batch"
    if "sequence" in dims and value.dim() >= 2 and not (value.is_floating_point()
                                                         or value.is_complex()):
        out[1] = "sequence"
    return out


def _dynamic_shapes(forward: Any, args: tuple[Any, ...], kwargs: Mapping[str, Any],
                    dims: tuple[str, ...], named: bool = False) -> dict[str, Any] | None:
    """``dynamic_shapes`` keyed by the forward's argument names.

    ``Dim.DYNAMIC`` lets ``torch.export`` infer each dimension's range (BERT's sequence is
    at most its position table) and fail if the model fixes it; ``named=True`` gives the
    names instead, which ``torch.onnx.export`` reads the same way and writes into the file.
    """
    if not dims:
        return None
    symbols = {name: name if named else torch.export.Dim.DYNAMIC for name in dims}

    def tensor_dims(value: torch.Tensor) -> dict[int, Any] | None:
        found = _dims_of(value, dims)
        small = [(d, value.shape[d]) for d in found if value.shape[d] < 2]
        if small:
            raise InputError(f"dynamic {found[small[0][0]]!r} is dimension {small[0][0]} "
                             f"of an example input of shape {tuple(value.shape)}, whose "
                             f"size {small[0][1]} export would fix; use an example with "
                             f"a size of at least 2 there.")
        return {d: symbols[name] for d, name in found.items()} or None

    return dynamic_shapes_for(forward, args, kwargs, tensor_dims)


def _whole_graph(optimized: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
                 expected: Any) -> tuple[GraphModule, str]:
    """The optimized graph module ``optimized`` runs for these inputs (as ``save_program``)."""
    specialization = optimized.specialization_for(args, kwargs)
    graph, served = specialization.graph, specialization.method
    if not isinstance(graph, GraphModule) or served != "export":
        unregistered = _unregistered_dataclass(expected)
        if unregistered is not None:
            name = unregistered.__name__
            raise ModelError(f"cannot export to ONNX: the model returns the dataclass {name}, "
                             f"which torch.export cannot take apart (it is not registered as "
                             f"a pytree node). Register it once before exporting, "
                             f"torch.export.register_dataclass({name}), or return a tuple or "
                             f"dict.")
        attempts = "; ".join(f"{m}: {why}" for c in optimized.report.captures
                             for m, why in c.attempts)
        method = served
        raise ModelError(f"cannot export to ONNX: the model was captured by {method!r}, "
                         f"not as one whole graph by torch.export, so there is no single graph "
                         f"to write. Make the model exportable with torch.export "
                         f"(capture attempts: {attempts or 'none recorded'}).")
    return portable(graph), served


def _unregistered_dataclass(value: Any) -> type | None:
    """The first dataclass type in an output that torch's pytree does not know."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        if type(value) not in pytree.SUPPORTED_NODES:
            return type(value)
        children = [getattr(value, f.name) for f in dataclasses.fields(value)]
    elif isinstance(value, (list, tuple)):
        children = list(value)
    elif isinstance(value, dict):
        children = list(value.values())
    else:
        return None
    return next((t for t in map(_unregistered_dataclass, children) if t is not None), None)


def _flat_tensors(args: tuple[Any, ...], kwargs: Mapping[str, Any],
                  names: Sequence[str]) -> dict[str, torch.Tensor]:
    tensors = [x for x in pytree.tree_leaves((tuple(args), dict(kwargs)))
               if isinstance(x, torch.Tensor)]
    return dict(zip(names, tensors, strict=True))


def _input_names(forward: Any, args: tuple[Any, ...], kwargs: Mapping[str, Any],
                 ) -> list[str]:
    """One name per tensor input, in pytree order of ``(args, kwargs)`` (the order the
    exporters give the inputs): the forward's argument name, with ``_0``, ``_key`` suffixes
    inside lists and dicts."""
    try:
        parameters = list(inspect.signature(forward).parameters.values())
    except (TypeError, ValueError):
        parameters = []
    positional = [p.name for p in parameters
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    star = next((p.name for p in parameters if p.kind is p.VAR_POSITIONAL), None)
    extra = next((p.name for p in parameters if p.kind is p.VAR_KEYWORD), None)
    bound: list[tuple[str, Any]] = []
    for i, value in enumerate(args):
        bound.append((positional[i] if i < len(positional) else
                      f"{star}_{i - len(positional)}" if star else f"input_{i}", value))
    for key, value in kwargs.items():
        known = key in positional or any(p.name == key and p.kind is p.KEYWORD_ONLY
                                         for p in parameters)
        bound.append((key if known or not extra else f"{extra}_{key}", value))
    names = []
    for name, value in bound:
        flat, _ = pytree.tree_flatten_with_path(value)
        for key_path, leaf in flat:
            if isinstance(leaf, torch.Tensor):
                suffix = "".join(f"_{_key_text(k)}" for k in key_path)
                names.append(_identifier(name + suffix))
    return _unique(names)


def _key_text(key: Any) -> str:
    for attr in ("key", "idx", "name"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def _output_names(expected: Any) -> list[str]:
    """``output['logits']`` -> ``logits``, ``output[0]`` -> ``output_0``, for tensor leaves."""
    names = []
    for where, leaf in _leaves(expected, "output"):
        if not isinstance(leaf, torch.Tensor):
            continue
        parts = re.findall(r"\[['\"]?([^'\"\]]+)['\"]?\]|\.(\w+)", where[len("output"):])
        text = "_".join(a or b for a, b in parts)
        names.append(_identifier(text if text and not text[0].isdigit() else
                                 f"output_{text}".rstrip("_")))
    return _unique(names)


def _identifier(text: str) -> str:
    return re.sub(r"\W", "_", text)


def _unique(names: list[str]) -> list[str]:
    seen: Counter[str] = Counter()
    out = []
    for name in names:
        seen[name] += 1
        out.append(name if seen[name] == 1 else f"{name}_{seen[name] - 1}")
    return out


def _weight_bytes(gm: GraphModule) -> int:
    """Bytes of every parameter, buffer and tensor constant the graph holds, each once."""
    tensors: dict[int, torch.Tensor] = {}
    for module in gm.modules():
        for value in (*module._parameters.values(), *module._buffers.values(),
                      *vars(module).values()):
            if isinstance(value, torch.Tensor):
                tensors[id(value)] = value
    return sum(t.numel() * t.element_size() for t in tensors.values())


# --- export ----------------------------------------------------------------------------------


def _export(gm: GraphModule, args: tuple[Any, ...], kwargs: dict[str, Any], path: Path,
            input_names: list[str], output_names: list[str], shapes: dict[str, Any] | None,
            dims: tuple[str, ...], opset: int | None, external: bool, exporter: str,
            ) -> tuple[str, str]:
    """Write ``path``; return (the exporter that succeeded, why dynamo was not used)."""
    reasons: list[str] = []
    if exporter in ("auto", "dynamo"):
        try:
            with _quiet():
                torch.onnx.export(gm, args, str(path), kwargs=kwargs, dynamo=True,
                                  input_names=input_names, output_names=output_names,
                                  opset_version=opset, dynamic_shapes=shapes,
                                  external_data=external, verbose=False)
            return "dynamo", ""
        except Exception as exc:  # noqa: BLE001 - recorded; the TorchScript exporter may work
            log.info("the dynamo ONNX exporter failed: %s", exc)
            reasons.append(f"dynamo: {type(exc).__name__}: {_first_line(exc)}")
    if exporter in ("auto", "torchscript"):
        flat = _flat_tensors(args, kwargs, input_names)
        axes = {name: _dims_of(t, dims) for name, t in flat.items() if _dims_of(t, dims)}
        try:
            with _quiet():
                torch.onnx.export(_Positional(gm, args, kwargs), tuple(flat.values()),
                                  str(path), dynamo=False,
                                  input_names=input_names, output_names=output_names,
                                  opset_version=opset, dynamic_axes=axes or None)
            return "torchscript", reasons[0] if reasons else "exporter='torchscript'"
        except Exception as exc:  # noqa: BLE001 - both reasons go into one error below
            log.info("the TorchScript ONNX exporter failed: %s", exc)
            reasons.append(f"torchscript: {type(exc).__name__}: {_first_line(exc)}")
    raise ModelError("no ONNX exporter could export the optimized graph (an op without an ONNX "
                     "translation is the usual cause; the message names it): "
                     + " | ".join(reasons))


class _Positional(nn.Module):
    """Calls the graph module with tensors given positionally, in ``input_names`` order.

    The TorchScript exporter traces with flat positional tensors, while a ``torch.export``
    graph module checks its call against the original (args, kwargs) structure. The graph
    module is kept unregistered because the exporter calls ``train(False)``, which such a
    module refuses.
    """

    def __init__(self, gm: GraphModule, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        super().__init__()
        object.__setattr__(self, "_gm", gm)
        # Registered here too, so that the tracer sees weights, not constants.
        self.weights = nn.ParameterList(gm.parameters())
        for i, buffer in enumerate(gm.buffers()):
            self.register_buffer(f"buffer_{i}", buffer)
        self._leaves, self._spec = pytree.tree_flatten((args, kwargs))

    def forward(self, *tensors: torch.Tensor) -> Any:
        given = iter(tensors)
        leaves = [next(given) if isinstance(x, torch.Tensor) else x for x in self._leaves]
        args, kwargs = pytree.tree_unflatten(leaves, self._spec)
        return self._gm(*args, **kwargs)


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """The exporters print progress and warn about training mode (the unlifted graph module
    reports training=True; the graph is an inference graph): keep that at debug level."""
    captured = io.StringIO()
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(captured), \
                contextlib.redirect_stderr(captured):
            warnings.simplefilter("ignore")
            yield
    finally:
        if captured.getvalue():
            log.debug("torch.onnx.export printed:\n%s", captured.getvalue())


def _first_line(exc: BaseException, limit: int = 300) -> str:
    """The first non-empty line of ``exc``, without terminal colour codes, cut at a word."""
    text = _ANSI.sub("", str(exc)).strip()
    line = next((line.strip() for line in text.splitlines() if line.strip()), "")
    if len(line) <= limit:
        return line
    return line[:limit].rsplit(" ", 1)[0] + " ..."


_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _opset(proto: Any) -> int:
    return next((o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")), 0)


def _count_nodes(proto: Any) -> dict[str, int]:
    """Top-level nodes by op type; a non-default domain prefixes the type
    (``com.microsoft.FusedConv``)."""
    return dict(Counter(f"{n.domain}.{n.op_type}" if n.domain not in ("", "ai.onnx")
                        else n.op_type for n in proto.graph.node))


def _graph_shapes(proto: Any) -> dict[str, list[int | str]]:
    initializers = {i.name for i in proto.graph.initializer}
    return {i.name: [d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim]
            for i in proto.graph.input if i.name not in initializers}


# --- verification ----------------------------------------------------------------------------


def _verify(report: OnnxReport, session: OnnxSession, eager: nn.Module, args: tuple[Any, ...],
            kwargs: dict[str, Any], input_names: list[str], dims: tuple[str, ...],
            random_inputs: int, tolerances: Mapping[torch.dtype, Tolerance] | None) -> None:
    """Fill ``report.verification`` (and ``dynamic_verification``) from eager vs ORT runs."""
    def run_pair(a: tuple[Any, ...], k: dict[str, Any]) -> tuple[Any, Any]:
        with torch.no_grad():
            expected = eager(*a, **k)
        tensors = [leaf for _, leaf in _leaves(expected, "output")
                   if isinstance(leaf, torch.Tensor)]
        feeds = {n: t for n, t in _flat_tensors(a, k, input_names).items()
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
        for d in _dims_of(t, dims):
            t = torch.cat([t, t.narrow(d, 0, 1)], d)
        return t

    return pytree.tree_map_only(torch.Tensor, grow, value)


# --- deployment ------------------------------------------------------------------------------

# Preferred first: TensorRT builds fused engines, CUDA runs every op, CPU catches the rest.
_GPU_PROVIDERS = ("TensorrtExecutionProvider", "CUDAExecutionProvider")
_ONNX_TYPES = {"tensor(float)": torch.float32, "tensor(float16)": torch.float16,
               "tensor(double)": torch.float64, "tensor(bfloat16)": torch.bfloat16,
               "tensor(int64)": torch.int64, "tensor(int32)": torch.int32,
               "tensor(bool)": torch.bool, "tensor(uint8)": torch.uint8,
               "tensor(int8)": torch.int8}


class OnnxSession:
    """An ONNX Runtime session that takes and returns torch tensors.

    Call it like the model (positional inputs in the file's input order, or by name); it
    returns one tensor, or a tuple when the model has several outputs. ``run`` maps names to
    tensors. On CUDA, inputs and outputs stay on the GPU through IO binding.
    """

    def __init__(self, session: Any, device: torch.device, io_binding: bool) -> None:
        self.session = session
        self.device = device
        self.providers: list[str] = session.get_providers()
        self.input_names = [i.name for i in session.get_inputs()]
        self.output_names = [o.name for o in session.get_outputs()]
        self.input_types = {i.name: _ONNX_TYPES.get(i.type) for i in session.get_inputs()}
        self.input_shapes = {i.name: list(i.shape) for i in session.get_inputs()}
        self._io_binding = io_binding

    def __call__(self, *args: torch.Tensor, **kwargs: torch.Tensor,
                 ) -> torch.Tensor | tuple[torch.Tensor, ...]:
        # Bound as Python binds a call: positions first, in the file's input order (the
        # forward's), then keywords, each input once.
        if len(args) > len(self.input_names):
            raise ArgumentError(f"{len(args)} positional inputs, but the model has "
                                f"{len(self.input_names)}: {self.input_names}")
        feeds = dict(zip(self.input_names, args, strict=False))
        twice = [name for name in kwargs if name in feeds]
        if twice:
            position = self.input_names.index(twice[0])
            raise ArgumentError(f"got multiple values for input {twice[0]!r}: as positional "
                                f"input {position} and as a keyword (the inputs, in order, "
                                f"are {self.input_names})")
        feeds.update(kwargs)
        outputs = self.run(feeds)
        values = tuple(outputs[n] for n in self.output_names)
        return values[0] if len(values) == 1 else values

    def run(self, feeds: Mapping[str, Any]) -> dict[str, torch.Tensor]:
        """Run on ``{input name: tensor}`` (torch tensors or numpy arrays); return
        ``{output name: tensor}``."""
        # Types first: a list where the file takes its tensors one by one is the real mistake,
        # not the inputs it leaves missing.
        feeds = {name: self._tensor(name, value) for name, value in feeds.items()}
        unknown = sorted(set(feeds) - set(self.input_names))
        missing = [n for n in self.input_names if n not in feeds]
        if unknown or missing:
            raise ArgumentError(f"the ONNX model's inputs are {self.input_names}; "
                                + (f"unknown: {unknown} " if unknown else "")
                                + (f"missing: {missing}" if missing else ""))
        try:
            if self._io_binding:
                return self._run_bound(feeds)
            arrays = {n: t.detach().cpu().numpy() for n, t in feeds.items()}
            values = self.session.run(self.output_names, arrays)
        except AutoOptError:
            raise
        except Exception as exc:
            raise InputError(f"ONNX Runtime rejected the inputs "
                             f"({_describe(feeds)}; expected {self.input_shapes}): "
                             f"{' '.join(str(exc).split())[:500]}") from exc
        return {n: torch.from_numpy(v) for n, v in zip(self.output_names, values, strict=True)}

    def _tensor(self, name: str, value: Any) -> torch.Tensor:
        if isinstance(value, torch.Tensor):
            return value
        if type(value).__module__ == "numpy" and hasattr(value, "__array__"):
            try:
                return torch.as_tensor(value)
            except (TypeError, RuntimeError) as exc:
                raise InputError(f"input {name!r}: a numpy array of dtype {value.dtype} that "
                                 f"torch cannot hold ({exc}); pass a torch.Tensor.") from exc
        hint = ""
        if isinstance(value, (list, tuple, dict)):
            flat = [n for n in self.input_names if n.startswith(f"{name}_")]
            hint = (f"; the file takes a {type(value).__name__}'s tensors as separate inputs: "
                    f"pass them as {', '.join(flat)}" if flat else
                    f"; the ONNX model takes one tensor per input ({self.input_names})")
        raise InputError(f"input {name!r} is a {type(value).__name__}, not a tensor{hint}. "
                         f"Pass torch tensors (or numpy arrays).")

    def _run_bound(self, feeds: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        # Inputs are read where they are and outputs are left where ORT wrote them (shared
        # with torch through DLPack): on a GPU, no copy through the host in either direction.
        kind = self.device.type
        index = self.device.index or 0
        binding = self.session.io_binding()
        keep = []  # the bound memory must outlive the run
        for name, value in feeds.items():
            value = value.detach().to(self.device).contiguous()
            keep.append(value)
            binding.bind_input(name, kind, index, _numpy_dtype(value.dtype),
                               tuple(value.shape), value.data_ptr())
        for name in self.output_names:
            binding.bind_output(name, kind, index)
        self.session.run_with_iobinding(binding)
        outputs = binding.get_outputs()
        return {n: torch.from_dlpack(v) for n, v in zip(self.output_names, outputs, strict=True)}


def _numpy_dtype(dtype: torch.dtype) -> Any:
    return torch.empty((), dtype=dtype).numpy().dtype


def _describe(feeds: Mapping[str, torch.Tensor]) -> str:
    return ", ".join(f"{n}: {str(t.dtype).removeprefix('torch.')}{list(t.shape)}"
                     for n, t in feeds.items())


def onnx_session(path: str | Path, device: str | torch.device = "cpu",
                 threads: int | None = None, optimized_model_path: str | Path | None = None,
                 ) -> OnnxSession:
    """Open an ONNX model with ONNX Runtime, ready to call with torch tensors.

    Args:
        path: the ``.onnx`` file.
        device: ``cpu``, ``cuda`` or ``cuda:N``. On CUDA the execution providers are
            TensorRT, CUDA and CPU, in that order, of those installed
            (``onnxruntime.get_available_providers()``); on the CPU, the CPU provider.
        threads: ORT intra-op threads; default: ORT's (one per physical core).
        optimized_model_path: where to save the model after ORT's graph optimizations.

    Returns:
        An ``OnnxSession``: ``session(x)`` or ``session.run({"x": x})``.

    Example:
        >>> session = autoopt.onnx_session("resnet.onnx", device="cuda")
        >>> logits = session(torch.randn(8, 3, 224, 224, device="cuda"))
    """
    ort = require("onnxruntime", "an ONNX Runtime session",
                  "pip install onnxruntime (onnxruntime-gpu for CUDA)")
    path = Path(path)
    if not path.is_file():
        raise ModelSpecError(f"no such .onnx file: {str(path)!r}")
    try:
        target = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise DeviceError(f"device={device!r} is not a device name; use 'cpu', 'cuda' or "
                          f"'cuda:N'.") from exc
    available = ort.get_available_providers()
    if target.type == "cuda":
        installed = [p for p in _GPU_PROVIDERS if p in available]
        if not installed:
            raise DeviceError(f"device={device!r}, but this onnxruntime has no GPU execution "
                              f"provider (available: {available}); install onnxruntime-gpu "
                              f"(pip install 'autoopt[gpu]') or use device='cpu'.")
        options = {"device_id": target.index or 0}
        if torch.cuda.is_available():
            # ORT then works on torch's stream, so bound inputs are ready without a sync.
            stream = torch.cuda.current_stream(target.index or 0).cuda_stream
            options["user_compute_stream"] = str(stream)
        providers: list[Any] = [(p, dict(options)) for p in installed]
        providers.append("CPUExecutionProvider")
    elif target.type == "cpu":
        providers = ["CPUExecutionProvider"]
    else:
        raise DeviceError(f"device={device!r}: ONNX sessions run on 'cpu' or 'cuda'.")
    options_ = ort.SessionOptions()
    options_.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    # Fatal only: ORT's errors come back as exceptions (reworded below), its warnings are
    # about its own choices, and a library should not write to the user's stderr.
    options_.log_severity_level = 4
    if threads:
        options_.intra_op_num_threads = threads
    if optimized_model_path is not None:
        options_.optimized_model_filepath = str(optimized_model_path)
        if (path.parent / f"{path.name}.data").exists():
            # A model too big for one protobuf stays too big after optimization.
            options_.add_session_config_entry(
                "session.optimized_model_external_initializers_file_name",
                f"{Path(optimized_model_path).name}.data")
    try:
        session = ort.InferenceSession(str(path), options_, providers=providers)
    except Exception as exc:
        raise ModelSpecError(f"{str(path)!r} is not a readable ONNX model: "
                             f"{_first_line(exc)}") from exc
    log.info("ONNX Runtime session for %s on %s", path, session.get_providers())
    return OnnxSession(session, target, io_binding=target.type == "cuda")
