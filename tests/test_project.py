"""The project's own promises: CI runs the README's commands, the layers point one way, and
the code is lint-clean."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _readme_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    block = text.split("## Set-up: two commands", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    return [line.strip() for line in block.strip().splitlines()]


def test_ci_runs_exactly_the_readme_commands() -> None:
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()
          if line.strip() and not line.startswith("#") and not line.startswith(("set ", "cd "))]
    assert ci == _readme_commands()


@pytest.mark.parametrize("layer, forbidden", [("cost_model", ("autoopt.passes", "autoopt.api")),
                                              ("passes", ("autoopt.api", "autoopt.pipeline"))])
def test_layers_point_one_way(layer: str, forbidden: tuple[str, ...]) -> None:
    for path in (ROOT / layer).glob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
                if node.level:  # a relative import must stay inside its own layer
                    assert node.level == 1, f"{path.name} reaches out of {layer}/"
                    continue
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            else:
                continue
            for name in names:
                assert not name.startswith(forbidden) and name != "autoopt", \
                    f"{path.name} imports {name}"


def test_ruff_is_clean() -> None:
    ruff = shutil.which("ruff")
    if ruff is None:
        pytest.skip("ruff is not installed (it is in the test extra)")
    done = subprocess.run([ruff, "check", str(ROOT)], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout


def test_installed_namespace_maps_the_folders() -> None:
    import autoopt.cost_model
    import autoopt.passes

    assert Path(autoopt.passes.__file__).parent.name == "passes" or "site-packages" in str(
        autoopt.passes.__file__)
    assert autoopt.cost_model.__name__ == "autoopt.cost_model"


@pytest.mark.slow
def test_readme_quick_start_runs_as_written() -> None:
    text = (ROOT / "README.md").read_text()
    block = text.split("## Quick start", 1)[1].split("```python", 1)[1].split("```", 1)[0]
    assert len(block.strip().splitlines()) <= 12
    done = subprocess.run([sys.executable, "-c", block], capture_output=True, text=True,
                          timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "capture: export" in done.stdout and "folded_bn=20" in done.stdout
