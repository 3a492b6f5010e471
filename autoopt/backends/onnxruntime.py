"""ONNX Runtime as a backend: an inference graph exported to ONNX and run in-process.

The graph from before autoopt's lowering passes is written by the same exporter
``autoopt.export_onnx`` uses, loaded into an ``InferenceSession`` (CPU provider with torch's
thread count on a CPU; TensorRT/CUDA where installed on a GPU, tensors bound in place) and
called with the model's own arguments: tensors go in without a copy (numpy views on a CPU) and
come back as torch tensors in the model's output structure.
"""

from __future__ import annotations

import importlib.metadata
import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch.fx import GraphModule
from torch.utils import _pytree as pytree

from autoopt.backends import static_int8
from autoopt.backends.base import Backend, Lowering, WholeGraph
from autoopt.capture import objects
from autoopt.cost_model.isolation import written_placeholders
from autoopt.errors import InputError
from autoopt.observe import memory_profile
from autoopt.onnx import graph as onnx_graph
from autoopt.onnx.session import OnnxSession, onnx_session
from autoopt.onnx.signature import flat_tensors, in_forward_order, name_inputs, name_outputs
from autoopt.onnx.writer import weight_bytes

log = logging.getLogger(__name__)


class OrtGraph:
    """Calls an ONNX Runtime session like the model: same arguments, same output structure.

    Args:
        session: the session over the exported graph.
        input_names: one name per tensor input, in pytree order of ``(args, kwargs)`` with
            the keywords in ``keywords``' order.
        expected: an output of the model, whose structure (and non-tensor leaves, which the
            graph specialized) the results are put back into.
        keywords: the keyword inputs' names in the graph's order: a call's keywords, in any
            order, are put in it before their tensors are matched to ``input_names``.
    """

    def __init__(self, session: OnnxSession, input_names: list[str], expected: Any,
                 keywords: Sequence[str] = (), lookups: Sequence[int] = ()) -> None:
        self.session = session
        # The inputs PyTorch indexes a table with (token ids into an embedding): where
        # eager raises on a negative index, ONNX's Gather counts it from the table's end.
        self._lookups = list(lookups)
        self.input_names = input_names
        self._keywords = list(keywords)
        leaves, self._spec = objects.flatten(expected)
        self._leaves = [None if isinstance(x, torch.Tensor) else x for x in leaves]
        self._single = self._spec.is_leaf() and self._leaves == [None]  # one tensor
        tensors = sum(isinstance(x, torch.Tensor) for x in leaves)
        if tensors != len(session.output_names):
            raise ValueError(f"the ONNX graph has {len(session.output_names)} outputs for "
                             f"the model's {tensors} output tensors")
        # ORT drops inputs the graph does not read: where those it kept sit among the call's
        # tensors, settled once rather than looked up by name on every call.
        position = {name: i for i, name in enumerate(input_names)}
        unknown = [name for name in session.input_names if name not in position]
        if unknown:
            raise ValueError(f"the ONNX graph takes inputs {unknown} that the model's "
                             f"{input_names} do not name")
        self._fed = [position[name] for name in session.input_names]

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not kwargs and len(args) == len(self.input_names) and all(map(_plain_tensor, args)):
            tensors: Any = args  # the common call: its tensors are its arguments, in order
        else:
            if list(kwargs) != self._keywords and set(kwargs) == set(self._keywords):
                # The guards match keywords in any order; the file's inputs are in one.
                kwargs = {key: kwargs[key] for key in self._keywords}
            tensors = list(flat_tensors(args, kwargs, self.input_names).values())
        for i in self._lookups:
            if tensors[i].numel() and int(tensors[i].min()) < 0:
                raise InputError(
                    f"input {self.input_names[i]!r} indexes a table (an embedding) with a "
                    f"negative value ({int(tensors[i].min())}), which the model rejects in "
                    f"eager (IndexError: index out of range) and ONNX Runtime would count "
                    f"from the table's end. Map padding or ignored ids to a valid index.")
        results = self.session.run_ordered([tensors[i].contiguous() for i in self._fed])
        if self._single:
            return results[0]
        values = iter(results)
        leaves = [next(values) if x is None else x for x in self._leaves]
        return pytree.tree_unflatten(leaves, self._spec)


def _plain_tensor(value: Any) -> bool:
    # A subclass (a Parameter, a tensor-like wrapper) takes the general path with pytree.
    return type(value) is torch.Tensor


def lower(gm: GraphModule, forward: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
          expected: Any, device: torch.device,
          exports: onnx_graph.Exports | None = None,
          quantize: Callable[[Path, list[str]], Path] | None = None) -> OrtGraph:
    """``gm`` exported to ONNX and opened in an ONNX Runtime session on ``device``.

    Args:
        gm: the graph to export (taking ``(args, kwargs)``).
        forward: the model's forward, which names the ONNX inputs.
        expected: the model's output on ``(args, kwargs)``.
        exports: keeps the exported file for another runtime of the same choice.
        quantize: writes the file an int8 one (QDQ), given the input names, and returns
            the new file's path (static int8).
    """
    # The exporter takes the keywords in the graph's own order (its forward's parameters, as
    # captured); given in another, it named each ONNX input after another's tensor.
    kwargs = in_forward_order(gm.forward, kwargs)
    input_names = name_inputs(forward, args, kwargs)
    output_names = name_outputs(expected)
    threads = torch.get_num_threads() if device.type == "cpu" else None

    def open_file(path: Path) -> OnnxSession:
        if quantize is not None:
            with memory_profile.stage("onnxruntime quantize"):
                path = quantize(path, input_names)
        with memory_profile.stage("onnxruntime session"):
            return onnx_session(path, device, threads=threads)

    session = onnx_graph.opened(gm, args, kwargs, input_names, output_names, device, expected,
                                open_file, "onnxruntime", exports)
    return OrtGraph(session, input_names, expected, list(kwargs), lookups(gm, input_names))


_LOOKUPS = {torch.ops.aten.embedding.default: 1}  # op: the position of its indices


def lookups(gm: GraphModule, input_names: Sequence[str]) -> list[int]:
    """The positions, among the graph's tensor inputs, of those an op indexes a table with."""
    inputs = [n for n in gm.graph.nodes if n.op == "placeholder"
              and isinstance(n.meta.get("val"), torch.Tensor)]
    if len(inputs) != len(input_names):
        return []  # not one placeholder per named input: no way to tell which is which
    return [i for i, node in enumerate(inputs)
            if not node.meta["val"].is_floating_point()
            and any(user.op == "call_function" and user.target in _LOOKUPS
                    and len(user.args) > _LOOKUPS[user.target]
                    and user.args[_LOOKUPS[user.target]] is node for user in node.users)]


def memory_estimate(gm: GraphModule) -> int:
    """Bytes that exporting ``gm`` and opening its session may add: the session's own copy of
    the weights, prepacked, and its first run's working memory (measured on a CPU, a
    106 M-parameter decoder: 1.47× the weights, the weights' file read back a block at a time
    for the cache; 3.2× when they were written into the protobuf)."""
    return weight_bytes(gm) * 3 // 2


def available() -> str:
    """Why ONNX Runtime cannot run here, or ''."""
    for package in ("onnxruntime", "onnx", "onnxscript"):
        try:
            importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            if package == "onnxruntime":
                try:
                    importlib.metadata.version("onnxruntime-gpu")
                    continue
                except importlib.metadata.PackageNotFoundError:
                    pass
            return f"{package} is not installed (pip install {package})"
    return ""


def version() -> str:
    for package in ("onnxruntime", "onnxruntime-gpu"):
        try:
            return importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            continue
    return "none"


# (provider, ONNX element type) -> whether the provider has a MatMul kernel for it; probed once.
_MATMUL_KERNELS: dict[tuple[str, int], bool] = {}
_PROVIDERS = {"cpu": "CPUExecutionProvider", "cuda": "CUDAExecutionProvider"}


def unsupported_dtypes(gm: GraphModule, device: torch.device | str = "cpu") -> str:
    """Why ONNX Runtime on ``device`` cannot run ``gm`` for the dtypes it computes in, or ''.

    ``precision="bf16"`` casts the matrix multiplies to bfloat16, for which ONNX Runtime's CPU
    provider has no kernel: building the candidate exported the graph and opened a session
    (15 s on a small model) only to fail with ONNX Runtime's raw error. A one-node MatMul
    session per low-precision dtype, opened once per process, says it up front (a provider
    that gains the kernel is used again without a change here)."""
    import onnx

    provider = _PROVIDERS.get(torch.device(device).type)
    if provider is None:
        return ""  # lower() refuses the device with its own reason
    for dtype in _low_precision_dtypes(gm):
        element = {torch.bfloat16: onnx.TensorProto.BFLOAT16,
                   torch.float16: onnx.TensorProto.FLOAT16}[dtype]
        if not _has_matmul(provider, element):
            name = str(dtype).removeprefix("torch.")
            return (f"ONNX Runtime {version()} has no {name} matrix multiply on "
                    f"{provider.removesuffix('ExecutionProvider')}, and the graph computes in "
                    f"{name}")
    return ""


def _low_precision_dtypes(gm: GraphModule) -> list[torch.dtype]:
    """bfloat16 and float16, where some value of ``gm`` (a node's result, a weight) has it."""
    low = (torch.bfloat16, torch.float16)
    found = {t.dtype for t in (*gm.parameters(), *gm.buffers()) if t.dtype in low}
    for node in gm.graph.nodes:
        for value in pytree.tree_leaves(node.meta.get("val")):
            if isinstance(value, torch.Tensor) and value.dtype in low:
                found.add(value.dtype)
    return [dtype for dtype in low if dtype in found]


def _has_matmul(provider: str, element: int) -> bool:
    key = (provider, element)
    if key not in _MATMUL_KERNELS:
        import onnx
        import onnxruntime
        from onnx import helper

        if provider not in onnxruntime.get_available_providers():
            return True  # not this check's to say: opening the candidate's session says why
        values = [helper.make_tensor_value_info(name, element, [2, 2]) for name in "abc"]
        graph = helper.make_graph([helper.make_node("MatMul", ["a", "b"], ["c"])], "probe",
                                  values[:2], values[2:])
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
        model.ir_version = min(model.ir_version, onnx.IR_VERSION, 8)
        try:
            onnxruntime.InferenceSession(model.SerializeToString(), providers=[provider])
            _MATMUL_KERNELS[key] = True
        except Exception as exc:  # noqa: BLE001 - no kernel (NOT_IMPLEMENTED), no provider
            log.debug("onnxruntime: no %s MatMul on %s: %s", element, provider, exc)
            _MATMUL_KERNELS[key] = False
    return _MATMUL_KERNELS[key]


class OnnxRuntime(Backend):
    name = "onnxruntime"

    def whole_graph(self, graph: WholeGraph) -> Lowering | str:
        source, device = graph.source, graph.device
        why = available() or (
            "inference only (ONNX Runtime computes no gradients)" if graph.gradients else
            "the graph takes the model's inputs positionally (symbolic_trace); ONNX export "
            "needs a torch.export graph" if graph.adapt is not None else
            "the graph writes its inputs in place (a KV cache); an ONNX graph returns new "
            "values and cannot" if written_placeholders(source) else
            f"no ONNX Runtime provider for {device.type}" if device.type not in _PROVIDERS
            else unsupported_dtypes(source, device) or onnx_graph.untranslatable(source))
        if graph.config.calibration is not None:
            return why or _static_int8(graph)
        if why:
            return why
        return Lowering(self.name, lambda: graph.warm(lower(
            source, graph.module.forward, graph.args, graph.kwargs, graph.expected(), device,
            exports=graph.exports)), memory=memory_estimate(source))


BACKEND = OnnxRuntime()


def _static_int8(graph: WholeGraph) -> Lowering:
    """The fp32 graph's ONNX file quantized (QDQ) on the calibration batches, in a session,
    with the ops int8 errs at most kept in floating point where it errs beyond the
    tolerance."""
    source = graph.source

    def attempt(kept: list[str]) -> OrtGraph:
        folder = static_int8.int8_folder()
        summary: list[static_int8.Summary] = []

        def quantize(path: Path, input_names: list[str]) -> Path:
            batches = static_int8.feeds(graph.config.calibration, source, input_names,
                                        graph.args, graph.kwargs)
            excluded = static_int8.onnx_nodes(path, kept) if kept else []
            out = static_int8.ort_quantize(path, batches, Path(folder.name), excluded)
            summary.append(static_int8.Summary("onnxruntime", static_int8.onnx_ops(out), kept))
            return out

        run = lower(source, graph.module.forward, graph.args, graph.kwargs, graph.expected(),
                    graph.device, graph.exports, quantize)
        run.int8 = summary[0]
        run.int8_folder = folder  # the session maps the file: kept while the session lives
        return run

    return static_int8.lowering("onnxruntime", graph, attempt, 3 * memory_estimate(source))
