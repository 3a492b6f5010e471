"""Writing a graph module as an ONNX file, and reading back what the file holds.

``write_onnx`` tries ``torch.onnx.export(dynamo=True)`` and then the TorchScript exporter, as
``exporter=`` allows, keeping their console output at debug level and recording why the dynamo
exporter was not used. A file at another opset than the one asked for is not written: the dynamo
exporter writes opset 18 and converts it down, and when that conversion fails torch keeps 18 and
only logs it. ``weight_bytes`` tells whether the weights need a side file.
``opset_of``, ``count_nodes`` and ``graph_shapes`` read the written proto for the report.
"""

from __future__ import annotations

import contextlib
import io
import logging
import warnings
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.fx import GraphModule
from torch.utils import _pytree as pytree

from autoopt.errors import ConfigError, ModelError, first_line
from autoopt.onnx.attention import with_empty_rows_zeroed
from autoopt.onnx.signature import dims_of, flat_tensors

log = logging.getLogger(__name__)


EXPORTERS = ("auto", "dynamo", "torchscript")


def write_onnx(gm: GraphModule, args: tuple[Any, ...], kwargs: dict[str, Any], path: Path,
               input_names: list[str], output_names: list[str], shapes: dict[str, Any] | None,
               dims: tuple[str, ...], opset: int | None, external: bool, exporter: str,
               ) -> tuple[str, str]:
    """Write ``path``; return (the exporter that succeeded, why dynamo was not used)."""
    gm = with_empty_rows_zeroed(gm)
    reasons: list[str] = []
    if exporter in ("auto", "dynamo"):
        try:
            with _quiet():
                torch.onnx.export(gm, args, str(path), kwargs=kwargs, dynamo=True,
                                  input_names=input_names, output_names=output_names,
                                  opset_version=opset, dynamic_shapes=shapes,
                                  external_data=external, verbose=False)
        except Exception as exc:  # noqa: BLE001 - recorded; the TorchScript exporter may work
            log.info("the dynamo ONNX exporter failed: %s", exc)
            reasons.append(f"dynamo: {type(exc).__name__}: {first_line(exc)}")
        else:
            wrong = _wrong_opset(path, opset)
            if not wrong:
                return "dynamo", ""
            log.info("the dynamo ONNX exporter %s", wrong)
            if exporter == "dynamo":
                path.unlink(missing_ok=True)
                raise ConfigError(f"exporter='dynamo' cannot write opset {opset} for this "
                                  f"model: it {wrong}. Pass exporter='auto' (the TorchScript "
                                  f"exporter writes opset {opset}) or a newer opset.")
            reasons.append(f"dynamo: {wrong}")
    if exporter in ("auto", "torchscript"):
        flat = flat_tensors(args, kwargs, input_names)
        axes = {name: dims_of(t, dims) for name, t in flat.items() if dims_of(t, dims)}
        try:
            with _quiet():
                torch.onnx.export(_Positional(gm, args, kwargs), tuple(flat.values()),
                                  str(path), dynamo=False,
                                  input_names=input_names, output_names=output_names,
                                  opset_version=opset, dynamic_axes=axes or None)
            wrong = _wrong_opset(path, opset)
            if wrong:
                raise ModelError(f"it {wrong}")
            return "torchscript", reasons[0] if reasons else "exporter='torchscript'"
        except Exception as exc:  # noqa: BLE001 - both reasons go into one error below
            log.info("the TorchScript ONNX exporter failed: %s", exc)
            reasons.append(f"torchscript: {type(exc).__name__}: {first_line(exc)}")
    raise ModelError("no ONNX exporter could export the optimized graph (an op without an ONNX "
                     "translation is the usual cause; the message names it): "
                     + " | ".join(reasons))


def _wrong_opset(path: Path, opset: int | None) -> str:
    """Why the file at ``path`` is not at ``opset`` (empty when it is, or when none was asked).

    Torch's dynamo exporter translates at opset 18 and converts the model down; when the
    conversion fails it keeps 18 and only logs a warning, so the file itself is read. The ops
    whose definition changed after ``opset`` are the ones the conversion had to rewrite: the
    error names them (``ReduceMean``, whose axes became an input in opset 18)."""
    if opset is None:
        return ""
    import onnx

    proto = onnx.load(str(path), load_external_data=False)
    written = opset_of(proto)
    if written == opset:
        return ""
    nodes = [*proto.graph.node, *(n for f in proto.functions for n in f.node)]
    types = {n.op_type for n in nodes if n.domain in ("", "ai.onnx")}
    changed = sorted(t for t in types if _since_version(t, written) > opset)
    return (f"wrote opset {written}, not {opset}: torch could not convert the model down"
            + (f" ({', '.join(changed)} changed after opset {opset})" if changed else ""))


def _since_version(op_type: str, opset: int) -> int:
    """The opset in which ``op_type``'s definition at ``opset`` appeared (0 if unknown)."""
    import onnx

    try:
        return onnx.defs.get_schema(op_type, opset).since_version
    except onnx.defs.SchemaError:
        return 0


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


def weight_bytes(gm: nn.Module) -> int:
    """Bytes of every parameter, buffer and tensor constant the module (a graph module, or a
    model) holds, each once."""
    tensors: dict[int, torch.Tensor] = {}
    for module in gm.modules():
        for value in (*module._parameters.values(), *module._buffers.values(),
                      *vars(module).values()):
            if isinstance(value, torch.Tensor):
                tensors[id(value)] = value
    return sum(t.numel() * t.element_size() for t in tensors.values())




def opset_of(proto: Any) -> int:
    """The opset of the default ONNX domain (0 when the file imports none)."""
    return next((o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")), 0)


def count_nodes(proto: Any) -> dict[str, int]:
    """Top-level nodes by op type; a non-default domain prefixes the type
    (``com.microsoft.FusedConv``)."""
    return dict(Counter(f"{n.domain}.{n.op_type}" if n.domain not in ("", "ai.onnx")
                        else n.op_type for n in proto.graph.node))


def graph_shapes(proto: Any) -> dict[str, list[int | str]]:
    """``input name -> shape`` (a dynamic dimension by its name), weights left out."""
    initializers = {i.name for i in proto.graph.initializer}
    return {i.name: [d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim]
            for i in proto.graph.input if i.name not in initializers}
