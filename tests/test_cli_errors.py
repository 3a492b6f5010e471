"""What the command line says when it cannot do what it was asked: one line that carries the
cause, nothing claimed done, no library's warnings or tracebacks without ``-v``."""

from __future__ import annotations

import json
import re
import zipfile
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn

from autoopt.cli import main


def _saved_program(path: Path) -> Path:
    torch.export.save(torch.export.export(nn.Linear(4, 2).eval(), (torch.randn(2, 4),)),
                      str(path))
    return path


def _newer_schema(path: Path) -> None:
    """The program as a torch with serialization schema 99 would have written it."""
    source = _saved_program(path.with_name("good.pt2"))
    with zipfile.ZipFile(source) as old, zipfile.ZipFile(path, "w") as new:
        for info in old.infolist():
            data = old.read(info.filename)
            if info.filename.endswith("models/model.json"):
                program = json.loads(data)
                program["schema_version"] = {"major": 99, "minor": 0}
                data = json.dumps(program).encode()
            new.writestr(info, data)


def _truncated(path: Path) -> None:
    data = _saved_program(path.with_name("good.pt2")).read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _not_a_zip(path: Path) -> None:
    path.write_bytes(b"not a zip archive")


@pytest.mark.parametrize("command", ["export", "diagnose"])
@pytest.mark.parametrize("make, cause", [
    (_newer_schema, r"schema version SchemaVersion\(major=99, minor=0\) does not match our "
                    r"current schema version \(\d+, \d+\); it was saved by another torch"),
    (_truncated, "a truncated archive"),
    (_not_a_zip, "not a zip archive"),
], ids=["newer-schema", "truncated", "not-a-zip"])
def test_an_unreadable_pt2_file_is_one_line_with_its_cause(
        tmp_path: Path, capfd: pytest.CaptureFixture[str], command: str,
        make: Callable[[Path], None], cause: str) -> None:
    """torch.export.load logged ~16 lines (its warning and traceback) and raised "check the
    warnings above"; the cause is the error's line now."""
    bad = tmp_path / "bad.pt2"
    make(bad)
    extra = ["-o", str(tmp_path / "m.onnx")] if command == "export" else []
    assert main([command, str(bad), "--input", "2x4", *extra]) == 2
    err = capfd.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith(f"autoopt: error: MODEL '{bad}' is not a readable torch.export "
                               "program: ")
    assert re.search(cause, lines[0]), lines[0]


def test_a_misspelt_model_name_offers_the_close_ones(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["optimize", "torchvision.models:resnet181", "--input", "1x3x8x8"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("autoopt: error: MODEL 'torchvision.models:resnet181': "
                          "'torchvision.models' has no attribute 'resnet181'; did you mean "
                          "'resnet18'"), err
    assert "'resnet'" not in err  # a submodule is no model


def test_a_failed_command_is_not_done(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    """Piped, ``autoopt optimize torchvision.models:resnet181`` wrote ``done in 6.0 s`` and
    then its error."""
    from autoopt.observe import progress

    monkeypatch.setattr(progress, "FIRST_S", 0.1)
    source = tmp_path / "slow_model.py"  # loading takes a second, then finds no Net
    source.write_text("import time\ntime.sleep(1.0)\n")
    assert main(["optimize", f"{source}:Net", "--input", "2x3"]) == 2
    lines = capsys.readouterr().err.splitlines()
    assert lines[0].startswith("autoopt optimize: "), lines  # progress was shown
    assert not any("done" in line for line in lines), lines
    assert lines[-1].startswith("autoopt: error: MODEL"), lines
