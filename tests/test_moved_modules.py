"""Import paths the documentation once gave keep working after the modules moved (the layout
of 2026-11-30): ``from autoopt.data import prefetch`` raised ModuleNotFoundError, only the
attribute ``autoopt.data.prefetch`` worked."""

from __future__ import annotations

import importlib

import pytest

# old path, the module now, a name code imported from it
MOVED = [("autoopt.data", "autoopt.runtime.prefetch", "prefetch"),
         ("autoopt.distributed", "autoopt.parallel.distributed", "distributed_pipeline"),
         ("autoopt.emit", "autoopt.export.program", "save_program")]


@pytest.mark.parametrize(("old", "new", "name"), MOVED)
def test_an_old_import_path_is_the_module_that_moved(old: str, new: str, name: str) -> None:
    module = importlib.import_module(old)
    assert module is importlib.import_module(new)  # one module: a patch on it holds for both
    assert getattr(module, name) is getattr(importlib.import_module(new), name)
    namespace: dict[str, object] = {}
    exec(f"from {old} import {name}", namespace)  # noqa: S102 - the statement users wrote
    assert namespace[name] is getattr(module, name)


def test_the_attribute_and_the_import_agree() -> None:
    import autoopt
    import autoopt.data

    assert autoopt.data is importlib.import_module("autoopt.runtime.prefetch")
