"""The autoopt command line: the README's command, MODEL specs, --save, and misuse."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from autoopt.cli import main


@pytest.mark.slow
def test_readme_command_runs_as_installed_console_script() -> None:
    exe = shutil.which("autoopt")
    assert exe is not None, "the autoopt console script is not installed"
    done = subprocess.run([exe, "optimize", "torchvision.models:resnet18", "--input",
                           "1x3x224x224"], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert "capture: export" in done.stdout
    assert "verification: matched" in done.stdout


def test_file_spec_named_inputs_and_save_round_trip(tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    source = tmp_path / "my_model.py"
    source.write_text(textwrap.dedent("""
        import torch
        from torch import nn

        class Scorer(nn.Module):
            def __init__(self):
                super().__init__()
                self.embed = nn.Embedding(50, 8)
                self.head = nn.Linear(8, 1)
                self.drop = nn.Dropout(0.1)

            def forward(self, ids, weight):
                return self.head(self.drop(self.embed(ids))).squeeze(-1) * weight
    """))
    saved = tmp_path / "scorer.pt2"
    code = main(["optimize", f"{source}:Scorer", "--input", "ids=2x7:int64", "--input",
                 "weight=2x7", "--int-high", "50", "--save", str(saved)])
    out = capsys.readouterr().out
    assert code == 0
    assert "capture: export" in out and "dropout=1" in out
    program = torch.export.load(str(saved))
    ids, weight = torch.randint(0, 50, (2, 7)), torch.randn(2, 7)
    assert program.module()(ids=ids, weight=weight).shape == (2, 7)

    code = main(["optimize", str(saved), "--input", "ids=2x7:int64", "--input", "weight=2x7",
                 "--int-high", "50"])
    assert code == 0
    assert "verification: matched" in capsys.readouterr().out


@pytest.mark.parametrize("argv, message", [
    (["optimize", "no_such_package:make", "--input", "1x3"], "cannot import 'no_such_package'"),
    (["optimize", "torchvision.models", "--input", "1x3"], "must be 'package.module:factory'"),
    (["optimize", "torchvision.models:no_such_model", "--input", "1x3"], "has no attribute"),
    (["optimize", "/nonexistent/model.py:Net", "--input", "1x3"], "no such file"),
    (["optimize", "missing.pt2", "--input", "1x3"], "no such .pt2 file"),
    (["optimize", "torchvision.models:resnet18", "--input", "1x3xabc"], "shape must look like"),
    (["optimize", "torchvision.models:resnet18", "--input", "1x3:float8"], "unknown dtype"),
    (["optimize", "torch.nn:Linear", "--input", "1x3"], "calling Linear() raised"),
    (["optimize", ":resnet18", "--input", "1x3"], "has no module or file"),
    (["optimize", "torchvision.models:", "--input", "1x3"], "has no name after the colon"),
    (["optimize", "torch.nn:Identity", "--input", "2x3:int64", "--int-high", "0"],
     "which is empty for --int-high 0"),
    (["optimize", "torch.nn:Identity", "--input", "x=2x3", "--input", "x=4x3"],
     "--input 'x=4x3' names 'x' again (after 'x=2x3')"),
])
def test_misuse_gives_a_clear_error(argv: list[str], message: str,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("package, source, error", [
    ("autoopt_test_syntax", "def broken(:\n", "raised SyntaxError"),
    ("autoopt_test_raises", "raise RuntimeError('no GPU here')\n",
     "raised RuntimeError: no GPU here"),
])
def test_a_package_module_that_fails_to_import(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                              capsys: pytest.CaptureFixture[str], package: str,
                                              source: str, error: str) -> None:
    (tmp_path / package).mkdir()
    (tmp_path / package / "__init__.py").write_text("")
    (tmp_path / package / "models.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert main(["optimize", f"{package}.models:Net", "--input", "1x3"]) == 2
    assert f"importing '{package}.models' {error}" in capsys.readouterr().err


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux's /proc")
@pytest.mark.parametrize("argv", [
    ["optimize", "torch.nn:Identity", "--input", "2x3", "--save", "/proc/autoopt/m.pt2"],
    ["profile", "torch.nn:Identity", "--input", "2x3", "--json", "/proc/autoopt.json"],
    ["export", "torch.nn:Identity", "--input", "2x3", "-o", "/proc/autoopt.onnx"],
    ["report", "torch.nn:Identity", "--input", "2x3", "-o", "/proc/autoopt.html"],
    ["partition", "torch.nn:Identity", "--input", "2x3", "--stages", "1", "--plot",
     "/proc/autoopt.png"],
], ids=["optimize", "profile", "export", "report", "partition"])
def test_an_unwritable_output_fails_before_the_work(argv: list[str],
                                                   monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    def load_model(spec: str) -> None:
        raise AssertionError("the model was loaded before the output path was checked")

    monkeypatch.setattr("autoopt.loading.load_model", load_model)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "cannot create the folder" in err or "cannot write there" in err
    assert argv[-1] in err


class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(8, 16)
        self.fc2 = torch.nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


def test_a_pt2_file_is_a_model_for_every_command(tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    pt2 = tmp_path / "net.pt2"
    torch.export.save(torch.export.export(_Net().eval(), (torch.randn(2, 8),)), str(pt2))
    onnx_path = tmp_path / "net.onnx"
    assert main(["export", str(pt2), "--input", "2x8", "-o", str(onnx_path)]) == 0
    assert "verification (ORT vs eager): matched" in capsys.readouterr().out
    costs = tmp_path / "new" / "costs.json"  # a missing folder is made, as for report -o
    assert main(["profile", str(pt2), "--input", "2x8", "--json", str(costs)]) == 0
    assert json.loads(costs.read_text())["nodes"]
    assert main(["partition", str(pt2), "--input", "2x8", "--stages", "2"]) == 0
    assert "stage" in capsys.readouterr().out


def test_optimize_dynamic_save_keeps_the_dynamic_dims(tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    source = tmp_path / "net.py"
    source.write_text(textwrap.dedent("""
        import torch

        class Net(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.fc = torch.nn.Linear(8, 4)

            def forward(self, x):
                return self.fc(x).view(x.shape[0], -1)
    """))
    saved = tmp_path / "out" / "net.pt2"  # into a folder that does not exist yet
    assert main(["optimize", f"{source}:Net", "--input", "2x8", "--dynamic", "--save",
                 str(saved)]) == 0
    assert "dynamic dimensions kept" in capsys.readouterr().out
    program = torch.export.load(str(saved))
    x = torch.randn(5, 8)
    assert program.module()(x).shape == (5, 4)


def test_unreadable_pt2_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.pt2"
    bad.write_bytes(b"not a zip archive")
    assert main(["optimize", str(bad), "--input", "1x3"]) == 2
    assert "not a readable torch.export program" in capsys.readouterr().err


def test_module_entry_point() -> None:
    done = subprocess.run([sys.executable, "-m", "autoopt.cli", "--help"], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0 and "optimize" in done.stdout


def test_profile_command_prints_the_top_ops_and_the_prediction(
        tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    out_json = tmp_path / "costs.json"
    code = main(["profile", "torchvision.models:resnet18", "--input", "1x3x64x64", "--top", "5",
                 "--json", str(out_json)])
    out = capsys.readouterr().out
    assert code == 0
    lines = out.splitlines()
    assert lines[0].split()[:3] == ["op", "calls", "time"]
    assert "aten.conv2d.default" in lines[1]  # convolutions dominate a ResNet
    assert len([line for line in lines if line.startswith("aten.")]) == 5
    assert "predicted" in out and "measured" in out and "error" in out
    data = json.loads(out_json.read_text())
    assert data["measured_s"] > 0 and data["predicted_s"] > 0
    assert any(n["op"] == "aten.conv2d.default" and n["measured"] for n in data["nodes"])
    assert (tmp_path / "cache" / "autoopt" / "costs.json").exists()


def test_profile_needs_a_whole_graph(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    source = tmp_path / "branchy.py"
    source.write_text(textwrap.dedent("""
        from torch import nn

        class Branchy(nn.Module):
            def forward(self, x):
                return x + 1 if x.sum() > 0 else x - 1
    """))
    assert main(["profile", f"{source}:Branchy", "--input", "4"]) == 2
    assert "profile needs a whole graph, but torch.export failed" in capsys.readouterr().err
    if not torch.cuda.is_available():
        assert main(["profile", f"{source}:Branchy", "--input", "4", "--device", "cuda"]) == 2
        assert "no CUDA GPU is available" in capsys.readouterr().err
