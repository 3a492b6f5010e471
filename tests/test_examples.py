"""The documentation's code runs: every ```python block of README.md and docs/*.md is (part of)
a script under examples/, every autoopt command of their ```bash blocks is run by one, and every
script runs.

Scripts run in a copy of examples/ (they write files: net.pt2, bert.onnx, report.html) with
``AUTOOPT_BACKENDS=aten`` (conftest's default; no Inductor compile or ONNX Runtime build per
graph) and tiny models (random weights from configs, nothing downloaded).
"""

from __future__ import annotations

import ast
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

# Scripts not run here, each with where it runs instead.
RUN_ELSEWHERE = {
    # Needs torchrun's process group; tests/test_pipelining.py runs it under torchrun --check.
    "pipeline_torchrun.py": "tests/test_pipelining.py",
}
# Scripts that take more than a few seconds (all still run in CI, where `slow` runs too).
SLOW = {"cli.py", "cost_model.py", "diagnose.py", "diagnose_cli.py", "generation.py",
        "html_report.py", "memory_budget.py", "onnx_export.py", "openvino_backend.py",
        "pipeline.py", "precision.py", "static_int8.py"}
# Modules the other scripts import or name on a command line (``my_model.py:Net``,
# ``data.py:make_loader``, ``tiny_lm.py:make_model``): they run through those.
HELPERS = {"data.py", "my_model.py", "tiny_lm.py"}

# Commands of ```bash blocks that are not autoopt's command line are not examples: installing
# (`pip install`, `apt-get`), the test suite (`pytest`), benchmarks (`python bench/...`, which
# write docs/benchmarks.md), shell recipes. An example named by `python examples/X.py` or
# `torchrun ... examples/X.py` must exist (and runs above, or where RUN_ELSEWHERE says).
# autoopt commands that record how a published figure was made, at full size, rather than
# show a use, are listed here with where they appear.
RECORDS = {
    "autoopt report torchvision.models:resnet50 --input 1x3x224x224 --threads 1 --steps 5 "
    "-o report_resnet50.html": "docs/report.md: how the resnet50 screenshot was made",
    "autoopt report torchvision.models:resnet50 --input 1x3x224x224 --threads 1 --steps 5 "
    "-o /tmp/report_resnet50.html": "docs/report.md: rendering the screenshots",
}


def _blocks(language: str) -> list[tuple[str, str]]:
    """(page, block) for every fenced block of ``language`` in the README and docs/."""
    found = []
    for page in PAGES:
        text = page.read_text()
        for match in re.finditer(rf"^```{language}\n(.*?)^```", text, re.S | re.M):
            found.append((str(page.relative_to(ROOT)), match.group(1)))
    return found


def _scripts() -> dict[str, str]:
    return {path.name: path.read_text() for path in sorted(EXAMPLES.glob("*.py"))}


def _split_imports(block: str) -> tuple[list[str], str]:
    """A block's leading import lines, and the rest. A script keeps its imports at its top
    (ruff's E402, in ruff's order), so a block's imports may sit there while the rest is
    verbatim further on."""
    lines = block.strip("\n").splitlines()
    imports = []
    while lines and (lines[0].startswith(("import ", "from ")) or not lines[0].strip()):
        line = lines.pop(0)
        if line.strip():
            imports.append(line)
    return imports, "\n".join(lines)


def _imported(source: str) -> set[tuple[str | None, str, str | None]]:
    """(module, name, as) of every top-level import statement of ``source``."""
    found = set()
    for node in ast.parse(source).body:
        if isinstance(node, ast.Import):
            found |= {(None, a.name, a.asname) for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            found |= {(node.module, a.name, a.asname) for a in node.names}
    return found


def _in_script(block: str, script: str) -> bool:
    if block.strip() in script:
        return True
    imports, body = _split_imports(block)
    return bool(body) and body in script and _imported("\n".join(imports)) <= _imported(script)


@pytest.mark.parametrize("page, block", _blocks("python"),
                         ids=lambda v: v if v.endswith(".md") else v.strip().splitlines()[-1][:40])
def test_every_python_block_is_in_an_example(page: str, block: str) -> None:
    scripts = _scripts()
    holders = [name for name, text in scripts.items() if _in_script(block, text)]
    assert holders, (f"{page}: this block is in no examples/*.py; put it in one (imports may "
                     f"sit at the script's top):\n{block}")


def test_every_python_block_defines_what_it_uses(tmp_path: Path) -> None:
    """No block reads a name it does not define or import (``ids``, ``mask``, ``llm``): each
    runs as written when pasted alone."""
    ruff = shutil.which("ruff")
    if ruff is None:
        pytest.skip("ruff is not installed (it is in the test extra)")
    files = []
    for i, (page, block) in enumerate(_blocks("python")):
        path = tmp_path / f"block_{i}.py"
        path.write_text(block)
        files.append((path, page))
    done = subprocess.run([ruff, "check", "--isolated", "--select", "F821,F822,F823",
                           *(str(p) for p, _ in files)], capture_output=True, text=True)
    pages = {p.name: page for p, page in files}
    report = re.sub(r"block_\d+\.py", lambda m: f"{m.group(0)} ({pages[m.group(0)]})",
                    done.stdout)
    assert done.returncode == 0, report


def _commands(block: str) -> list[str]:
    """The block's commands: continuation lines joined, comments dropped, spaces normalized."""
    joined = re.sub(r"\\\n\s*", " ", block)
    commands = []
    for line in joined.splitlines():
        line = line.split("  #", 1)[0].strip()
        if line and not line.startswith("#"):
            commands.append(" ".join(line.split()))
    return commands


def _autoopt_commands() -> list[tuple[str, str]]:
    return [(page, command) for page, block in _blocks("bash") for command in _commands(block)
            if command.startswith("autoopt ")]


@pytest.mark.parametrize("page, command", _autoopt_commands(),
                         ids=lambda v: v if v.endswith(".md") else v[:60])
def test_every_autoopt_command_is_run_by_an_example(page: str, command: str) -> None:
    if command in RECORDS:
        return
    scripts = {name: " ".join(text.split()) for name, text in _scripts().items()}
    holders = [name for name, text in scripts.items() if command in text]
    assert holders, (f"{page}: `{command}` is run by no examples/*.py (run it there with "
                     f"autoopt.cli.main or a subprocess, or list it in RECORDS with why not)")


def test_the_readme_s_commands_name_files_from_the_clone_s_root() -> None:
    """The README's ``autoopt optimize my_model.py:Net`` failed where its reader types it, at
    the clone's root: the file is examples/my_model.py. Every ``FILE.py:NAME`` of its
    commands is a file there (examples/cli.py runs them from the root)."""
    for page, command in _autoopt_commands():
        if page != "README.md":
            continue
        for path in re.findall(r"(\S+\.py):\w+", command):
            assert (ROOT / path).is_file(), f"README.md: `{command}`: no {path} at the root"


def test_every_named_example_exists() -> None:
    for page, block in _blocks("bash"):
        for command in _commands(block):
            for name in re.findall(r"examples/(\w+\.py)", command):
                assert (EXAMPLES / name).exists(), f"{page}: `{command}`: no examples/{name}"


def _quick_start() -> str:
    text = (ROOT / "README.md").read_text()
    return text.split("## Quick start", 1)[1].split("```python", 1)[1].split("```", 1)[0]


def _runs() -> list[pytest.param]:
    params = []
    for path in sorted(EXAMPLES.glob("*.py")):
        if path.name in RUN_ELSEWHERE or path.name in HELPERS:
            continue
        if path.read_text().strip() == _quick_start().strip():
            # The README's quick start as written: tests/test_project.py runs it and reads
            # its output.
            continue
        marks = [pytest.mark.slow] if path.name in SLOW else []
        params.append(pytest.param(path.name, marks=marks, id=path.stem))
    return params


@pytest.mark.parametrize("name", _runs())
def test_example_runs(name: str, tmp_path: Path) -> None:
    work = tmp_path / "examples"
    shutil.copytree(EXAMPLES, work, ignore=shutil.ignore_patterns("__pycache__", "*.pt2",
                                                                   "*.onnx", "*.html"))
    env = {**os.environ, "AUTOOPT_BACKENDS": os.environ.get("AUTOOPT_BACKENDS", "aten"),
           "AUTOOPT_PROGRESS": "0"}
    done = subprocess.run([sys.executable, name], cwd=work, env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, f"examples/{name} failed:\n{done.stdout[-3000:]}\n" \
                                 f"{done.stderr[-3000:]}"


def test_the_quick_start_is_an_example_as_written() -> None:
    """examples/quick_start.py is the README's quick start, so the two cannot drift (the
    block's run is tests/test_project.py's)."""
    assert (EXAMPLES / "quick_start.py").read_text().strip() == _quick_start().strip()


def test_commands_parse() -> None:
    """Every autoopt command shown splits as a shell would (no stray quotes)."""
    for _page, command in _autoopt_commands():
        shlex.split(command)


def test_every_link_between_pages_resolves() -> None:
    """README.md and docs/*.md link each other and examples/; every relative link names a file
    or folder that exists (pages move: the README was split into docs/)."""
    broken = []
    for page in PAGES:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue  # a URL, or an anchor in the same page
            path = (page.parent / target.split("#", 1)[0]).resolve()
            if not path.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target}")
    assert not broken, broken
