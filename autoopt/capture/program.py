"""Write an optimized module out as a ``torch.export`` program, and read one back."""

from __future__ import annotations

import logging
import traceback
import warnings
import zipfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.fx import GraphModule
from torch.fx._pytree import tree_flatten_spec
from torch.fx.experimental.symbolic_shapes import is_concrete_int

from autoopt.capture.graph import dynamic_shapes_for
from autoopt.errors import ModelError, ModelSpecError
from autoopt.passes.graph import portable

log = logging.getLogger(__name__)


def save_program(optimized: Any, args: tuple[Any, ...], kwargs: Mapping[str, Any],
                 path: str) -> None:
    """Save the graph ``optimized`` runs for these inputs as a ``torch.export`` ``.pt2`` file.

    Only whole-graph captures can be saved; a model that runs partly eagerly cannot. The
    dimensions the graph keeps symbolic (``dynamic=True``, ``dynamic_shapes=``) stay dynamic
    in the program.
    """
    if getattr(getattr(optimized, "config", None), "calibration", None) is not None:
        raise ModelError("cannot save: static int8 (calibration=) runs as an OpenVINO or ONNX "
                         "Runtime model that its quantizer made, which a torch.export program "
                         "cannot hold; a saved program would be the fp32 graph. Save without "
                         "calibration=, or run the optimized module in-process.")
    # The inference graph (an eval model is captured under no_grad).
    with torch.no_grad():
        served = optimized.specialization_for(tuple(args), dict(kwargs))
    graph = served.graph
    if not isinstance(graph, GraphModule) or served.method != "export":
        raise ModelError(f"cannot save: the model was captured by {served.method!r}, "
                         "not as one whole graph, so there is no single program to write. "
                         "Make the model exportable (see the report's capture attempts).")
    gm = portable(graph)
    program = torch.export.export(gm, tuple(args), dict(kwargs), strict=False,
                                  dynamic_shapes=symbolic_dims(gm, tuple(args), dict(kwargs)))
    torch.export.save(program, path)


def symbolic_dims(gm: GraphModule, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``dynamic_shapes`` marking each input dimension that is symbolic in ``gm`` (``None``
    when all are static): exporting the graph again with example inputs alone would fix every
    size to the example's.

    ``Dim.DYNAMIC``: export infers the range again and fails rather than silently fixing a
    dimension the graph holds symbolic.
    """
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    in_spec = getattr(gm, "_in_spec", None)
    if in_spec is None:
        return None
    leaves = tree_flatten_spec((list(args), kwargs), in_spec)
    symbolic: dict[int, dict[int, Any]] = {}
    for leaf, node in zip(leaves, placeholders, strict=False):
        value = node.meta.get("val")
        if isinstance(leaf, torch.Tensor) and isinstance(value, torch.Tensor):
            dims = {d: torch.export.Dim.DYNAMIC for d, size in enumerate(value.shape)
                    if not is_concrete_int(size)}
            if dims:
                symbolic[id(leaf)] = dims
    if not symbolic:
        return None
    return dynamic_shapes_for(gm.forward, args, kwargs, lambda t: symbolic.get(id(t)))


def load_program(path: Path, what: str) -> nn.Module:
    """The module of the ``.pt2`` program at ``path``; ``what`` names it in errors.

    ``torch.export.load`` logs the real cause (a newer schema version, a zip it cannot read)
    as a warning with a traceback, then raises "check the warnings above". Here that record is
    kept from the console (at INFO, ``-v`` shows it) and its cause is the error's one line.
    """
    if not path.is_file():
        raise ModelSpecError(f"{what}: no such .pt2 file")
    if not zipfile.is_zipfile(path):  # a .pt2 is a zip archive, its directory at the end
        with path.open("rb") as f:
            started = f.read(4) == b"PK\x03\x04"
        raise ModelSpecError(
            f"{what} is not a readable torch.export program: "
            + ("a truncated archive (a zip that stops before its end: copy or save it again)"
               if started else "not a zip archive (torch.export.save writes one)"))
    causes: list[logging.LogRecord] = []

    def keep(record: logging.LogRecord) -> bool:
        causes.append(record)
        return False

    torch_log = logging.getLogger("torch.export")
    torch_log.addFilter(keep)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            module = torch.export.load(str(path)).module()
    except Exception as exc:
        cause = _cause(causes) or f"{type(exc).__name__}: {exc}"
        hint = ("; it was saved by another torch version: load it with that one, or save it "
                f"again with this one (torch {torch.__version__})"
                if "schema version" in cause else "")
        message = f"{what} is not a readable torch.export program: {cause}{hint}"
        raise ModelSpecError(message) from exc
    finally:
        torch_log.removeFilter(keep)
        for record in causes:
            trace = "".join(traceback.format_exception(*record.exc_info)).rstrip() \
                if record.exc_info else ""
            log.info("torch.export.load: %s%s", record.getMessage(), "\n" + trace if trace
                     else "")
    # torch.export makes train() and eval() raise, since they cannot change a program
    # whose mode is baked into its ops. The commands call them to choose how to capture;
    # with nn.Module's own methods they set the flags and the graph stays as exported.
    for method in ("train", "eval"):
        vars(module).pop(method, None)
    return module


def _cause(records: list[logging.LogRecord]) -> str:
    """The last line of the first exception torch logged: the error, without its traceback."""
    for record in records:
        if record.exc_info and record.exc_info[1] is not None:
            error = record.exc_info[1]
            line = str(error).strip().splitlines()[0] if str(error).strip() else ""
            return f"{type(error).__name__}: {line.rstrip('.')}"
    return ""
