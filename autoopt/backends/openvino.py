"""OpenVINO as a backend: an inference graph read from autoopt's ONNX file, compiled for the CPU.

OpenVINO is what Intel CPU users deploy with (it runs on AMD x86 CPUs too). The graph from
before autoopt's lowering passes is written by the exporter ``autoopt.export_onnx`` uses (or
taken from the ONNX cache with this run's weights, see ``onnx_graph``), read by OpenVINO's ONNX
frontend and compiled for the CPU with torch's thread count, a latency hint and one stream.
Its calls take the model's own arguments through ``OrtGraph`` (the same binding of a call's
tensors to the file's inputs as ONNX Runtime's): tensors go in as numpy views, without a copy,
and come back as tensors of their own.

Precision: OpenVINO's CPU plugin runs in bf16 by default where the CPU has it (AMX, AVX-512
BF16), which is not the model's function. Without ``precision=`` the inference precision hint
is ``f32``; under ``precision="bf16"`` a second candidate compiles the fp32 graph with the
``bf16`` hint (OpenVINO keeps its own accuracy-sensitive ops in f32), verified under the
precision's tolerance like autoopt's own bf16 graph.

The ONNX frontend rather than ``openvino.convert_model`` on the exported program: the ONNX file
is cached (a second ``optimize`` reads it back in a tenth of a second, where the PyTorch
frontend converts again, 2.5 s for a resnet18), it is the file ONNX Runtime runs, so both
candidates share one export, and its dynamic dimensions are the ones ``export_onnx`` keeps.
"""

from __future__ import annotations

import importlib.metadata
import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.fx import GraphModule

from autoopt.backends import static_int8
from autoopt.backends.base import Backend, Lowering, WholeGraph
from autoopt.backends.onnxruntime import OrtGraph, lookups
from autoopt.check.state import preserved
from autoopt.cost_model.isolation import written_placeholders
from autoopt.errors import AutoOptError, InputError
from autoopt.observe import memory_profile
from autoopt.onnx import graph as onnx_graph
from autoopt.onnx.signature import flat_tensors, in_forward_order, name_inputs, name_outputs
from autoopt.onnx.writer import weight_bytes
from autoopt.passes.graph import full_precision

log = logging.getLogger(__name__)

# What each precision is called by OpenVINO's inference precision hint.
HINTS = {"fp32": "f32", "bf16": "bf16"}

# Dtypes numpy can view without a copy (OpenVINO takes numpy arrays): bf16 has no numpy dtype.
_NUMPY_DTYPES = frozenset({torch.float32, torch.float64, torch.float16, torch.int64,
                           torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool})


class OvSession:
    """A compiled OpenVINO model with ``OnnxSession``'s interface for ``OrtGraph``: input and
    output names, and ``run_ordered`` (tensors in the inputs' order -> tensors of their own).

    Each thread gets an infer request of its own: one request serves one call at a time, and
    an optimized module may be called from several threads.
    """

    def __init__(self, compiled: Any, precision: str, threads: int,
                 input_names: Sequence[str]) -> None:
        self.compiled = compiled
        self.precision = precision
        self.threads = threads
        # A port may carry several tensor names: the one the ONNX file gave the input.
        self.input_names = [next((n for n in input_names if n in port.get_names()),
                                 port.get_any_name()) for port in compiled.inputs]
        # A traced model's outputs may carry no tensor name (OpenVINO then raises on asking).
        self.output_names = [port.get_any_name() if port.get_names() else f"output_{i}"
                             for i, port in enumerate(compiled.outputs)]
        self._local = threading.local()

    def run_ordered(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        request = getattr(self._local, "request", None)
        if request is None:
            request = self._local.request = self.compiled.create_infer_request()
        try:
            arrays = [_array(t) for t in tensors]
            # share_inputs: numpy views of torch's memory, read in place; outputs copied out
            # of the request's buffers, which its next call overwrites.
            results = request.infer(arrays, share_inputs=True, share_outputs=False)
        except AutoOptError:
            raise
        except Exception as exc:
            shapes = [f"{tuple(t.shape)}:{t.dtype}" for t in tensors]
            raise InputError(f"OpenVINO rejected the inputs ({', '.join(shapes)}): "
                             f"{' '.join(str(exc).split())[:500]}") from exc
        return [torch.from_numpy(results[port]) for port in self.compiled.outputs]


def _array(t: torch.Tensor) -> Any:
    if t.dtype not in _NUMPY_DTYPES:
        raise InputError(f"OpenVINO takes numpy arrays, and {t.dtype} has no numpy dtype")
    return t.detach().cpu().contiguous().numpy()


def lower(gm: GraphModule, forward: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
          expected: Any, device: torch.device, precision: str = "fp32",
          exports: onnx_graph.Exports | None = None,
          quantize: Callable[[Any, list[str], Any], Any] | None = None) -> OrtGraph:
    """``gm`` exported to ONNX (or read from the ONNX cache) and compiled by OpenVINO.

    Args:
        gm: the graph to export (taking ``(args, kwargs)``).
        forward: the model's forward, which names the ONNX inputs.
        expected: the model's output on ``(args, kwargs)``.
        precision: ``fp32`` or ``bf16``: OpenVINO's inference precision hint; ``int8``:
            the model ``quantize`` returns, at OpenVINO's default precision elsewhere
            (``int8+fp32``: in f32 elsewhere).
        exports: where ONNX Runtime's candidate left the same graph's file, if it did.
        quantize: makes the model read from the file an int8 one (NNCF), given the input
            names and the file (static int8).
    """
    kwargs = in_forward_order(gm.forward, kwargs)
    input_names = name_inputs(forward, args, kwargs)
    output_names = name_outputs(expected)
    threads = torch.get_num_threads()
    config = {"INFERENCE_NUM_THREADS": threads, "PERFORMANCE_HINT": "LATENCY",
              "NUM_STREAMS": 1}
    hint = HINTS.get(precision.removeprefix("int8+"))
    if hint is not None:  # plain int8: OpenVINO's default elsewhere
        config["INFERENCE_PRECISION_HINT"] = hint

    def compile_file(path: Any) -> OvSession:
        ov_core = core()
        model = ov_core.read_model(str(path))
        if quantize is not None:
            with memory_profile.stage("nncf quantize"):
                model = quantize(model, input_names, path)
        with memory_profile.stage("openvino compile"):
            compiled = ov_core.compile_model(model, "CPU", config)
        return OvSession(compiled, precision, threads, input_names)

    session = onnx_graph.opened(gm, args, kwargs, input_names, output_names, device, expected,
                                compile_file, "openvino", exports)
    run = OrtGraph(session, input_names, expected, list(kwargs), lookups(gm, input_names))
    log.info("openvino: compiled in %s with %d threads", precision, threads)
    return run


def core() -> Any:
    """The process's one ``openvino.Core``, made on first use and kept until the process ends.

    Each Core loads a CPU plugin of its own, and the plugin puts an alternate signal stack of
    its own on the thread that creates it; when the plugin is destroyed it unmaps that stack
    and puts back the one it found. Two plugins destroyed in the order they were made (an
    earlier model released before a later one, as a loop of optimizes does) left the thread
    pointing at an unmapped stack, and the next signal with a handler (a child process's exit,
    Ctrl-C) killed the process with SIGSEGV. One Core, never destroyed, is one plugin that
    never is; it also saves each compile the plugin's start-up.
    """
    global _CORE
    with _CORE_LOCK:
        if _CORE is None:
            import openvino as ov

            _CORE = ov.Core()
        return _CORE


_CORE: Any = None
_CORE_LOCK = threading.Lock()


def describe(precision: str) -> str:
    """What the report says of a graph OpenVINO runs, where it runs in reduced precision."""
    if precision == "fp32":
        return ""
    return (f"OpenVINO in {precision} (its inference precision hint) on the graph before "
            f"autoopt's casts")


def unsupported(gm: GraphModule, device: torch.device, gradients: bool, positional: bool,
                writes_inputs: bool) -> str:
    """Why OpenVINO cannot take ``gm`` here, or ''."""
    return (available()
            or ("inference only (OpenVINO computes no gradients)" if gradients else "")
            or ("the graph takes the model's inputs positionally (symbolic_trace); ONNX "
                "export needs a torch.export graph" if positional else "")
            or ("the graph writes its inputs in place (a KV cache); an OpenVINO model "
                "returns new values and cannot" if writes_inputs else "")
            or (f"OpenVINO's CPU plugin only here (the model is on {device.type})"
                if device.type != "cpu" else "")
            or _dtypes(gm) or onnx_graph.untranslatable(gm))


def _dtypes(gm: GraphModule) -> str:
    for node in gm.graph.nodes:
        value = node.meta.get("val")
        if node.op == "placeholder" and isinstance(value, torch.Tensor) \
                and value.dtype not in _NUMPY_DTYPES:
            return f"input {node.name!r} is {value.dtype}, which OpenVINO's numpy inputs " \
                   f"cannot hold"
    return ""


def memory_estimate(gm: GraphModule) -> int:
    """Bytes that exporting ``gm`` and compiling it may add: OpenVINO's own copy of the
    weights (repacked for its kernels) and the file's, read while compiling."""
    return weight_bytes(gm) * 2


def available() -> str:
    """Why OpenVINO cannot run here, or ''."""
    for package in ("openvino", "onnx", "onnxscript"):
        try:
            importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            return f"{package} is not installed (pip install {package})"
    return ""


def version() -> str:
    try:
        return importlib.metadata.version("openvino")
    except importlib.metadata.PackageNotFoundError:
        return "none"


class OpenVino(Backend):
    name = "openvino"

    def whole_graph(self, graph: WholeGraph) -> Lowering | str:
        # Under precision="bf16", OpenVINO's own bf16 mode on the graph before autoopt's
        # casts: its hint, verified under the precision's tolerance like autoopt's map.
        precision, source = precision_of(graph)
        why = unsupported(source, graph.device, graph.gradients, graph.adapt is not None,
                          bool(written_placeholders(source)))
        if graph.config.calibration is not None:
            return why or static_int8.nncf_available() or _static_int8(graph)
        if why:
            return why
        return Lowering(self.name, lambda: graph.warm(lower(
            source, graph.module.forward, graph.args, graph.kwargs, graph.expected(),
            graph.device, precision, graph.exports)),
            memory=memory_estimate(source), regions=lambda: describe(precision))


BACKEND = OpenVino()


def _static_int8(graph: WholeGraph) -> Lowering:
    """The fp32 graph quantized by NNCF on the calibration batches, compiled by OpenVINO,
    with the ops int8 errs at most kept in floating point where it errs beyond the
    tolerance."""
    source = graph.source

    def attempt(kept: list[str]) -> OrtGraph:
        excluded: list[str] = []

        def quantize(model: Any, input_names: list[str], path: Any) -> Any:
            batches = static_int8.feeds(graph.config.calibration, source, input_names,
                                        graph.args, graph.kwargs)
            excluded.extend(static_int8.onnx_nodes(path, kept) if kept else [])
            return static_int8.nncf_quantize(model, batches, static_int8.is_transformer(source),
                                             excluded)

        # What int8 leaves runs at OpenVINO's default precision (bf16 where the CPU has it),
        # as its own int8 deployments do; once ops are kept for accuracy, in f32.
        run = lower(source, graph.module.forward, graph.args, graph.kwargs, graph.expected(),
                    graph.device, "int8" if not kept else "int8+fp32", graph.exports, quantize)
        run.int8 = static_int8.Summary("openvino", static_int8.openvino_ops(
            run.session.compiled), kept)
        return run

    def exported() -> OrtGraph:
        """NNCF on OpenVINO's own conversion of the model, as its users quantize: its
        patterns match more of what that conversion makes than of the ONNX file's model
        (mobilenet_v3_large: 62 of its convolutions in int8, 4.4 ms at batch 1 on one
        thread, against 47 and 6.5 ms; a random-weight BERT-base errs 2.8% where the
        exported program's conversion errs 6%)."""
        kwargs = in_forward_order(source.forward, graph.kwargs)
        input_names = name_inputs(graph.module.forward, graph.args, kwargs)
        with memory_profile.stage("openvino convert"):
            model = _converted(graph, source, input_names, kwargs)
        if len(model.inputs) != len(input_names):
            raise ValueError(f"the converted model takes {len(model.inputs)} inputs for the "
                             f"graph's {len(input_names)}")
        for port, name in zip(model.inputs, input_names, strict=True):
            port.get_tensor().set_names({name})
        batches = static_int8.feeds(graph.config.calibration, source, input_names,
                                    graph.args, graph.kwargs)
        with memory_profile.stage("nncf quantize"):
            model = static_int8.nncf_quantize(model, batches,
                                              static_int8.is_transformer(source))
        threads = torch.get_num_threads()
        with memory_profile.stage("openvino compile"):
            compiled = core().compile_model(model, "CPU", {
                "INFERENCE_NUM_THREADS": threads, "PERFORMANCE_HINT": "LATENCY",
                "NUM_STREAMS": 1})
        run = OrtGraph(OvSession(compiled, "int8", threads, input_names), input_names,
                       graph.expected(), list(kwargs), lookups(source, input_names))
        run.int8 = static_int8.Summary("openvino", static_int8.openvino_ops(compiled))
        return run

    def first(kept: list[str]) -> OrtGraph:
        # Ops kept in floating point are named by the ONNX file's nodes.
        if kept:
            return attempt(kept)
        try:
            return exported()
        except Exception as exc:  # noqa: BLE001 - the ONNX file's route instead
            log.info("openvino: the exported program does not convert (%s); quantizing the "
                     "ONNX file's model", exc)
            return attempt(kept)

    return static_int8.lowering("openvino", graph, first, 3 * memory_estimate(source))


def _converted(graph: WholeGraph, source: GraphModule, input_names: list[str],
               kwargs: dict[str, Any]) -> Any:
    """``openvino.convert_model`` of the model (traced by TorchScript, as OpenVINO converts a
    module), or of the exported program where tracing fails or the inputs are nested."""
    import openvino as ov

    tensors = flat_tensors(graph.args, kwargs, input_names)
    if len(graph.args) + len(kwargs) == len(tensors):
        try:
            with preserved(graph.module), torch.no_grad():
                return ov.convert_model(graph.module, example_input=tensors)
        except Exception as exc:  # noqa: BLE001 - the exported program's conversion instead
            log.info("openvino: the model does not convert by tracing (%s)", exc)
    return ov.convert_model(torch.export.export(source, graph.args, kwargs, strict=False))


def precision_of(graph: WholeGraph) -> tuple[str, GraphModule]:
    """The precision OpenVINO runs in, and the graph it is given: under a precision it has a
    hint for, the graph from before autoopt cast it."""
    fp32 = full_precision(graph.gm)
    if graph.config.precision in HINTS and fp32 is not None:
        return graph.config.precision, fp32
    return "fp32", graph.source
