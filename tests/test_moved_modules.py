"""Import paths the documentation once gave keep working after the modules moved (the layouts
of 2026-11-30 and 2026-12-06): ``from autoopt.data import prefetch`` raised ModuleNotFoundError,
only the attribute ``autoopt.data.prefetch`` worked."""

from __future__ import annotations

import importlib

import pytest

# old path, the module now, a name code imported from it
MOVED = [("autoopt.data", "autoopt.runtime.prefetch", "prefetch"),
         ("autoopt.distributed", "autoopt.parallel.distributed", "distributed_pipeline"),
         ("autoopt.emit", "autoopt.capture.program", "save_program"),
         ("autoopt.export.program", "autoopt.capture.program", "save_program"),
         ("autoopt.export.session", "autoopt.onnx.session", "onnx_session"),
         ("autoopt.state", "autoopt.check.state", "preserved"),
         ("autoopt.verify", "autoopt.check.compare", "Tolerance"),
         ("autoopt.memory_profile", "autoopt.observe.memory_profile", "recording"),
         ("autoopt.capture.dynamo", "autoopt.compile.dynamo", "autoopt_backend")]


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


def test_every_old_path_names_a_module_that_exists() -> None:
    from autoopt.old_paths import MOVED

    for old, new in MOVED.items():
        assert importlib.import_module(old) is importlib.import_module(new), old
        # the module keeps its own identity: reload and pickling read __spec__
        assert importlib.import_module(new).__spec__.name == new


def test_import_autoopt_resolves_no_old_path_until_asked() -> None:
    import subprocess
    import sys

    code = ("import sys, autoopt; "
            "assert 'torch' not in sys.modules; "
            "from autoopt.old_paths import MOVED; "
            "assert not any(name in sys.modules for name in MOVED)")
    subprocess.run([sys.executable, "-c", code], check=True)
