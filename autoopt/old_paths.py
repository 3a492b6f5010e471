"""Import paths of modules that moved, kept working: ``from autoopt.data import prefetch``,
``autoopt.verify.Tolerance``, ``autoopt.export.session.onnx_session``.

An old path is the very same module object as its new one, not a copy, so a name set or patched
through either is seen through both. The finder resolves an old path only when something imports
it: ``import autoopt`` stays free of torch.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
from types import ModuleType

# old path -> the module it is now
MOVED = {
    "autoopt.data": "autoopt.runtime.prefetch",  # layout of 2026-11-30
    "autoopt.distributed": "autoopt.parallel.distributed",
    "autoopt.emit": "autoopt.capture.program",
    "autoopt.export.program": "autoopt.capture.program",  # layout of 2026-12-06
    "autoopt.export.session": "autoopt.onnx.session",
    "autoopt.export.onnx_writer": "autoopt.onnx.writer",
    "autoopt.export.onnx_io": "autoopt.onnx.signature",
    "autoopt.export.onnx_attention": "autoopt.onnx.attention",
    "autoopt.backends.onnx_cache": "autoopt.onnx.cache",
    "autoopt.backends.onnx_graph": "autoopt.onnx.graph",
    "autoopt.capture.dynamo": "autoopt.compile.dynamo",
    "autoopt.planning.partition": "autoopt.parallel.partition",
    "autoopt.progress": "autoopt.observe.progress",
    "autoopt.memory_profile": "autoopt.observe.memory_profile",
    "autoopt.state": "autoopt.check.state",
    "autoopt.report": "autoopt.check.report",
    "autoopt.verify": "autoopt.check.compare",
    "autoopt.config": "autoopt.options.config",
    "autoopt.precision_target": "autoopt.options.precision",
    "autoopt.driver": "autoopt.compile.pass_runner",
    "autoopt.specialize": "autoopt.compile.specialize",
    "autoopt.guards": "autoopt.compile.guards",
    "autoopt.watch": "autoopt.module.watch",
    "autoopt.concurrency": "autoopt.module.concurrency",
    "autoopt.build": "autoopt.module.build",
}


class _Alias(importlib.abc.Loader):
    """Loads an old path as the module it moved to."""

    def __init__(self, target: str) -> None:
        self.target = target
        self.own_spec: importlib.machinery.ModuleSpec | None = None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        module = importlib.import_module(self.target)
        self.own_spec = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        """Nothing to run: the module ran when it was imported under its own name. Importing
        set its ``__spec__`` to the old path's; it keeps its own (reload and pickling read it)."""
        module.__spec__ = self.own_spec


class OldPaths(importlib.abc.MetaPathFinder):
    """Finds the old paths of :data:`MOVED`, and nothing else."""

    def find_spec(self, fullname: str, path: object = None,
                  target: object = None) -> importlib.machinery.ModuleSpec | None:
        if fullname not in MOVED:
            return None
        return importlib.machinery.ModuleSpec(fullname, _Alias(MOVED[fullname]))


def install() -> None:
    """Put the finder on ``sys.meta_path``, once."""
    if not any(isinstance(finder, OldPaths) for finder in sys.meta_path):
        sys.meta_path.append(OldPaths())
