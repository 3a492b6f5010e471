"""The ONNX file of a graph, opened by a runtime: from the cache with this run's weights, or
exported (and cached) where there is no usable entry.

ONNX Runtime and OpenVINO both run the file ``autoopt.export_onnx`` writes; the second of them
to be built for a graph reads the first one's export back from the cache (``onnx_cache``)
instead of exporting again.
"""

from __future__ import annotations

import logging
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch
from torch.fx import GraphModule

from autoopt.capture import objects
from autoopt.capture.program import symbolic_dims
from autoopt.observe import memory_profile
from autoopt.onnx import cache as onnx_cache
from autoopt.onnx.writer import write_onnx

log = logging.getLogger(__name__)

Opened = TypeVar("Opened")


class Exports:
    """The ONNX files exported during one backend choice, by cache key, so that the second
    runtime given the same graph (OpenVINO after ONNX Runtime) opens the first one's file
    where the cache cannot hold it (the exporter computed a weight of its own: a BERT, a
    GPT-2), instead of exporting again (9 s of a 4-layer BERT's optimize). The files hold
    the weights as they were then: ``close()`` at the end of the choice, before any write.
    """

    def __init__(self) -> None:
        self._folder: tempfile.TemporaryDirectory[str] | None = None
        self._files: dict[str, Path] = {}

    def get(self, entry: str) -> Path | None:
        return self._files.get(entry)

    def path(self, entry: str) -> Path:
        """Where to export the file of ``entry``, kept until ``close``."""
        if self._folder is None:
            # On Windows a file a runtime maps cannot be deleted while its session lives.
            self._folder = tempfile.TemporaryDirectory(prefix="autoopt-onnx-",
                                                       ignore_cleanup_errors=True)
        folder = Path(self._folder.name) / str(len(self._files))
        folder.mkdir()
        self._files[entry] = folder / "graph.onnx"
        return self._files[entry]

    def close(self) -> None:
        self._files.clear()
        if self._folder is not None:
            self._folder.cleanup()
            self._folder = None

    def __enter__(self) -> Exports:
        return self

    def __exit__(self, *_: Any) -> None:
        self.close()


# Ops a CPU kernel computes that ONNX has no translation for: autoopt's own (``autoopt_blocks``)
# and ATen's weight-only int8/int4 products. Exporting a graph that holds one fails after the
# export's whole trace (10 s on GPT-2's int4 forward): the engines that read ONNX say so first.
_UNTRANSLATABLE_NAMESPACES = ("autoopt_blocks",)
_UNTRANSLATABLE = frozenset(getattr(torch.ops.aten, name).default for name in (
    "_weight_int8pack_mm", "_weight_int4pack_mm", "_weight_int4pack_mm_for_cpu")
    if hasattr(torch.ops.aten, name))


def untranslatable(gm: GraphModule) -> str:
    """Why ``gm`` cannot be exported to ONNX for its ops, or ''."""
    for node in gm.graph.nodes:
        target = node.target
        if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
            continue
        if target in _UNTRANSLATABLE or target.namespace in _UNTRANSLATABLE_NAMESPACES:
            return (f"the graph runs {target.name()} (a CPU kernel of precision=), which ONNX "
                    f"has no translation for")
    return ""


def opened(gm: GraphModule, args: tuple[Any, ...], kwargs: dict[str, Any],
           input_names: list[str], output_names: list[str], device: torch.device,
           expected: Any, open_file: Callable[[Path], Opened], runtime: str,
           exports: Exports | None = None) -> Opened:
    """``open_file`` called on the ONNX file of ``gm`` (inputs and outputs named
    ``input_names``, ``output_names``; ``kwargs`` in the graph's order), which may delete
    the file once it returns (unless ``exports`` keeps it for another runtime).

    A graph captured with ``dynamic=`` keeps its symbolic sizes symbolic in the file, which
    then serves every size the graph does.
    """
    cacheable = device.type == "cpu"
    shapes = symbolic_dims(gm, args, kwargs)
    entry = onnx_cache.key(gm, args, kwargs, input_names, output_names, device, shapes)
    kept = exports.get(entry) if exports is not None else None
    if kept is not None:
        log.info("%s: the graph exported for another backend of this choice", runtime)
        return open_file(kept)
    # On Windows a file a runtime maps cannot be deleted while its session lives.
    with tempfile.TemporaryDirectory(prefix=f"autoopt-{runtime}-",
                                     ignore_cleanup_errors=True) as folder:
        path = Path(folder) / "graph.onnx"
        # The graph exported by an earlier optimize of this graph, given this run's weights.
        if cacheable and onnx_cache.materialize(entry, gm, path):
            try:
                result = open_file(path)
            except Exception as exc:  # noqa: BLE001 - a damaged entry costs an export
                log.info("%s: the cached graph does not open (%s); exporting again",
                         runtime, exc)
            else:
                log.info("%s: the exported graph from autoopt's cache, with this run's "
                         "weights", runtime)
                log.debug("%s: ONNX cache entry %s", runtime, entry)
                return result
        if exports is not None:
            path = exports.path(entry)
        # The weights go to a file beside the graph, always: written into the protobuf they
        # were serialized in memory and parsed back by the session, each a copy of them
        # (a 106 M-parameter decoder: this candidate's growth +1.28 → +0.57 GiB, 6.4 → 4.7 s).
        with memory_profile.stage("onnx export"), objects.scoped_for(expected):
            # (scoped_for: a DynamicCache output, see capture.objects)
            write_onnx(gm, args, kwargs, path, input_names, output_names, shapes, (), None,
                       True, "auto")
        if cacheable:
            try:
                with memory_profile.stage("onnx cache entry"):
                    why = onnx_cache.store(entry, path, gm)
            except Exception as exc:  # noqa: BLE001 - an unwritable cache costs a re-export
                why = f"{type(exc).__name__}: {exc}"
            if why:
                log.debug("%s: the exported graph is not cached: %s", runtime, why)
        # The runtime maps the weights' file and makes its own copies of what it prepacks;
        # the folder can go once it is open.
        return open_file(path)
