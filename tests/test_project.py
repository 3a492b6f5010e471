"""The project's own promises: CI runs the README's commands, the layers and packages point one
way, modules stay small and keep their underscore names, and the code is lint-clean."""

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


@pytest.mark.parametrize("layer, allowed", [("cost_model", ("autoopt.cost_model",)),
                                            ("passes", ("autoopt.passes", "autoopt.cost_model"))])
def test_layers_point_one_way(layer: str, allowed: tuple[str, ...]) -> None:
    """cost_model <- passes <- autoopt: a lower layer imports nothing of the ones above."""
    for path in (ROOT / layer).rglob("*.py"):
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
                if name == "autoopt" or name.startswith("autoopt."):
                    assert name.startswith(allowed), f"{path.name} imports {name}"


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


def _modules() -> dict[str, Path]:
    """Every module of the installed namespace, by dotted name, from the three folders."""
    found: dict[str, Path] = {}
    for package, folder in (("autoopt", "autoopt"), ("autoopt.passes", "passes"),
                            ("autoopt.cost_model", "cost_model")):
        for path in (ROOT / folder).rglob("*.py"):
            parts = [package, *path.relative_to(ROOT / folder).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join(parts)] = path
    return found


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The modules ``name`` imports, lazily or not (``from . import x`` counts as x)."""
    base = name if path.stem == "__init__" else name.rsplit(".", 1)[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:
                parts = base.split(".")
                parent = ".".join(parts[: len(parts) - (node.level - 1)])
                module = f"{parent}.{module}" if node.module else parent
            for alias in node.names:
                sub = f"{module}.{alias.name}"
                out.add(sub if sub in modules else module)
        elif isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
    return {m for m in out if m in modules and m != name}


def test_no_import_cycle_inside_autoopt_lazy_imports_included() -> None:
    import networkx as nx

    modules = _modules()
    graph = nx.DiGraph()
    for name, path in modules.items():
        graph.add_edges_from((name, other) for other in _imports(name, path, modules))
    cycles = sorted(nx.simple_cycles(graph), key=len)
    assert not cycles, f"import cycles: {cycles[:5]}"


# The packages of the installed namespace from the bottom up: a module imports from its own
# package or from one on a lower row, lazily or not (docs/design.md, "Layout"). Packages on one
# row may import each other as long as no cycle forms between packages.
LAYERS = [("cost_model",), ("passes",), ("errors", "old_paths"), ("observe",), ("planning",),
          ("check",), ("options",), ("capture", "onnx", "runtime"), ("backends",), ("compile",),
          ("module",), ("generation", "export", "parallel", "diagnose"), ("api",),
          ("cli", "__main__", "autoopt")]


def _package(module: str) -> str:
    """The package of ``autoopt.<package>...`` (a root module is its own; ``autoopt`` the
    namespace's ``__init__``)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def _package_edges() -> dict[tuple[str, str], list[str]]:
    modules = _modules()
    edges: dict[tuple[str, str], list[str]] = {}
    for name, path in modules.items():
        for other in _imports(name, path, modules):
            if _package(name) != _package(other):
                edges.setdefault((_package(name), _package(other)), []).append(
                    f"{name} -> {other}")
    return edges


def test_every_package_has_a_layer() -> None:
    ranked = {p for row in LAYERS for p in row}
    assert {_package(m) for m in _modules()} <= ranked


def test_packages_import_only_their_own_layer_or_lower() -> None:
    rank = {p: i for i, row in enumerate(LAYERS) for p in row}
    upward = [why for (a, b), whys in _package_edges().items() if rank[b] > rank[a]
              for why in whys]
    assert not upward, upward


def test_no_import_cycle_between_packages() -> None:
    import networkx as nx

    edges = _package_edges()
    cycles = list(nx.simple_cycles(nx.DiGraph(list(edges))))
    assert not cycles, [(c, [w for e in zip(c, c[1:] + c[:1], strict=True) for w in edges[e]][:4])
                        for c in cycles]


def test_no_module_imports_another_modules_underscore_names() -> None:
    """An underscore name is its module's own; what another module needs is made public."""
    modules = _modules()
    offenders = []
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith(
                    "autoopt")):
                offenders += [f"{name}:{node.lineno} {alias.name}" for alias in node.names
                              if alias.name.startswith("_") and not alias.name.startswith("__")]
    assert not offenders, offenders


def test_no_module_is_longer_than_600_lines() -> None:
    """A module that grew past this does more than one job; split it by job."""
    long = {name: n for name, path in _modules().items()
            if (n := len(path.read_text().splitlines())) > 600}
    assert not long, long


def test_only_the_defining_module_reads_optimized_modules_privates() -> None:
    """Features and tests use ``config``, ``specializations``, ``graph_for``, ``is_dynamic``:
    an underscore attribute of ``OptimizedModule`` read anywhere else is a reach into its
    implementation."""
    import torch.nn as nn

    source = ROOT / "autoopt" / "module" / "optimized.py"
    cls = next(n for n in ast.parse(source.read_text()).body
               if isinstance(n, ast.ClassDef) and n.name == "OptimizedModule")
    private = {n.name for n in ast.walk(cls) if isinstance(n, ast.FunctionDef)}
    private |= {n.attr for n in ast.walk(cls) if isinstance(n, ast.Attribute)
                and isinstance(n.value, ast.Name) and n.value.id == "self"}
    private = {n for n in private if n.startswith("_") and not n.startswith("__")
               and not hasattr(nn.Module, n)}
    assert {"_specializations", "_config", "_find"} <= private
    offenders = []
    for folder in ("autoopt", "passes", "cost_model", "tests", "bench"):
        for path in (ROOT / folder).rglob("*.py"):
            if path == source:
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                # self._x inside another class is that class's own attribute.
                if (isinstance(node, ast.Attribute) and node.attr in private
                        and not (isinstance(node.value, ast.Name) and node.value.id == "self")):
                    offenders.append(f"{path.relative_to(ROOT)}:{node.lineno} .{node.attr}")
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ImportFrom) and (node.module or "").endswith(
                        ("api", "module")) and any(a.name.startswith("_") for a in node.names):
                    offenders.append(f"{path.relative_to(ROOT)}:{node.lineno} imports a private")
    assert not offenders, offenders


def test_design_layout_table_lists_every_folder() -> None:
    text = (ROOT / "docs" / "design.md").read_text().split("## Layout", 1)[1]
    table = {line.split("|")[1].strip().strip("`") for line in text.splitlines()
             if line.startswith("| `")}
    folders = {f"{p.relative_to(ROOT)}/" for p in (ROOT / "autoopt").iterdir()
               if (p / "__init__.py").exists()}
    folders |= {"autoopt/", "passes/", "cost_model/", "tests/", "bench/", "docs/"}
    assert folders <= table, sorted(folders - table)


def test_every_subpackage_is_listed_for_installation() -> None:
    # pyproject lists the packages explicitly (three top-level folders make one namespace);
    # an editable install finds an unlisted subpackage anyway, `pip install .` does not.
    import tomllib

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
                 ["packages"])
    found = {".".join(("autoopt", *init.parent.relative_to(ROOT / "autoopt").parts))
             for init in (ROOT / "autoopt").rglob("__init__.py")}
    assert found - listed == set(), f"add to pyproject's packages: {sorted(found - listed)}"
