"""The autoopt command line: the README's command, MODEL specs, --save, and misuse."""

from __future__ import annotations

import io
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

import autoopt
from autoopt.cli import main
from autoopt.options.config import OptimizeConfig
from autoopt.passes import PASS_NAMES

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_readme_command_runs_as_installed_console_script() -> None:
    exe = shutil.which("autoopt")
    assert exe is not None, "the autoopt console script is not installed"
    done = subprocess.run([exe, "optimize", "torchvision.models:resnet18", "--input",
                           "1x3x224x224"], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert "capture: export" in done.stdout
    assert "verification: matched" in done.stdout
    # Piped: no status line to redraw (no carriage returns, no escapes); where optimize runs
    # past the first progress interval (a loaded machine), plain timed lines, then "done".
    assert "\r" not in done.stderr and "\x1b[" not in done.stderr
    lines = done.stderr.splitlines()
    assert all(line.startswith("autoopt optimize: ") for line in lines), lines
    assert not lines or lines[-1].startswith("autoopt optimize: done in")


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
    (["optimize", "torch.nn:Identity", "--input", "2x3", "--threads", "0"],
     "--threads 0 is not a thread count"),
    (["run", "missing.onnx", "--input", "2x3", "--threads", "0"],
     "--threads 0 is not a thread count"),
    (["optimize", "torch.nn:Identity", "--input", "2x3", "--save", "model.ONNX"],
     "--save writes a torch.export program (.pt2), not ONNX"),
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

    monkeypatch.setattr("autoopt.cli.loading.load_model", load_model)
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


def test_a_pt2_file_is_optimized_for_inference_unless_train(tmp_path: Path) -> None:
    """``ExportedProgram.module()`` comes back in train mode: without ``--train`` the program
    was optimized for training (a gradient capture, no inference backend)."""
    import argparse

    from autoopt.cli.common import load_workload

    pt2 = tmp_path / "net.pt2"
    torch.export.save(torch.export.export(_Net().eval(), (torch.randn(2, 8),)), str(pt2))
    args = argparse.Namespace(model=str(pt2), threads=None, input=["2x8"], dtype="float32",
                              int_high=100)
    for train in (False, True):
        model, _, _ = load_workload(args, train=train)
        assert model.training is train


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


def test_dynamic_batch_takes_an_example_batch_of_1(tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """The README's ``--input input_ids=1x128:int64 --dynamic batch --save net.pt2`` failed:
    export fixes a size of 1. The example is drawn with a batch of 2, said so, and the saved
    program takes a batch of 1 and of 3."""
    source = tmp_path / "my_model.py"
    source.write_text(textwrap.dedent("""
        import torch

        class Net(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.embed = torch.nn.Embedding(100, 8)
                self.fc = torch.nn.Linear(8, 4)

            def forward(self, input_ids):
                return self.fc(self.embed(input_ids)).mean(1)
    """))
    saved = tmp_path / "net.pt2"
    assert main(["optimize", f"{source}:Net", "--input", "input_ids=1x16:int64", "--dynamic",
                 "batch", "--save", str(saved)]) == 0
    out = capsys.readouterr().out
    assert "--input input_ids=1x16:int64: captured at 2x16:int64" in out
    assert "dynamic dimensions kept" in out
    program = torch.export.load(str(saved)).module()
    for batch in (1, 3):
        assert program(input_ids=torch.randint(0, 100, (batch, 16))).shape == (batch, 4)


def test_dynamic_widens_only_the_dimensions_it_names() -> None:
    from autoopt.cli.loading import widened_for_dynamic

    specs = ["ids=1x1:int64", "1x1", "mask=1x1:bool", "3x5"]
    assert widened_for_dynamic(specs, ("sequence",), "float32")[0] == [
        "ids=1x2:int64", "1x1", "mask=1x2:bool", "3x5"]  # sequence: integer inputs' dim 1
    assert widened_for_dynamic(specs, ("batch",), "float32")[0] == [
        "ids=2x1:int64", "2x1", "mask=2x1:bool", "3x5"]
    assert widened_for_dynamic(specs, (), "float32") == (specs, [])
    assert widened_for_dynamic(["1x1"], ("sequence",), "float32")[0] == ["1x1"]  # a float


@pytest.mark.parametrize("command", ["optimize", "diagnose", "report"])
def test_train_and_training_are_one_option_everywhere(command: str) -> None:
    from autoopt.cli import parser

    extra = ["-o", "r.html"] if command == "report" else []
    for flag in ("--train", "--training"):
        args = parser().parse_args([command, "torch.nn:Identity", "--input", "2x3", flag,
                                    *extra])
        assert (args.train if command == "optimize" else args.training) is True


@pytest.mark.parametrize("module", ["autoopt.cli", "autoopt"])
def test_module_entry_point(module: str) -> None:
    done = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0 and "optimize" in done.stdout


@pytest.mark.parametrize("argv", [["--help"], ["--version"], ["optimize", "--help"],
                                  ["export", "--help"], ["generate", "--help"]])
def test_help_and_version_import_no_torch(argv: list[str]) -> None:
    """``autoopt --help`` took 17 s on a loaded machine importing torch and all of autoopt;
    it imports neither now (a generous bound on the time: machines vary)."""
    code = textwrap.dedent(f"""
        import sys
        from autoopt.cli import main
        try:
            main({argv!r})
        except SystemExit as exc:
            assert exc.code == 0, exc.code
        heavy = sorted(m for m in ("torch", "autoopt.api", "autoopt.passes") if m in sys.modules)
        assert not heavy, heavy
    """)
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    elapsed = time.perf_counter() - started
    assert done.returncode == 0, done.stderr
    assert "usage: autoopt" in done.stdout or done.stdout.startswith("autoopt ")
    assert elapsed < 5, elapsed


def test_the_command_ends_when_its_output_is_written(tmp_path: Path) -> None:
    """The shell got its prompt back 5-25 s after the result: tearing down torch's thousands
    of modules at exit. A module whose teardown takes 20 s stands for them here; the program
    ends once its output is written and flushed, without waiting for it."""
    source = tmp_path / "slow_exit.py"
    source.write_text(textwrap.dedent("""
        import time
        from torch import nn

        class _SlowTeardown:
            def __del__(self):
                time.sleep(20)

        sentinel = _SlowTeardown()

        def Net():
            return nn.Linear(4, 3)
    """))
    saved = tmp_path / "net.pt2"
    env = {**os.environ, "AUTOOPT_BACKENDS": "aten"}
    process = subprocess.Popen([sys.executable, "-m", "autoopt", "optimize", f"{source}:Net",
                                "--input", "2x4", "--save", str(saved)],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env=env)
    assert process.stdout is not None
    out, last_line = "", time.perf_counter()
    for line in process.stdout:  # each line as it comes
        out += line
        last_line = time.perf_counter()
    process.wait(timeout=120)
    assert time.perf_counter() - last_line < 10  # not the 20 s teardown
    assert process.returncode == 0, process.stderr.read() if process.stderr else ""
    assert "autoopt report" in out and out.endswith(f"saved {saved}\n")  # all of it, flushed
    assert torch.export.load(str(saved)).module()(torch.randn(2, 4)).shape == (2, 3)


def test_the_parsers_lists_are_the_librarys() -> None:
    """The CLI keeps its own copies of these names so that --help imports no torch."""
    from autoopt.cli import names
    from autoopt.onnx.writer import EXPORTERS
    from autoopt.passes.precision import PRECISIONS

    assert names.PASS_NAMES == PASS_NAMES
    assert names.PRECISIONS == PRECISIONS
    assert names.EXPORTERS == EXPORTERS


def test_import_autoopt_is_light_and_its_names_load_on_use() -> None:
    code = textwrap.dedent("""
        import sys
        import autoopt
        assert "torch" not in sys.modules
        import autoopt.diagnose.collect  # the subpackage does not replace the function
        assert callable(autoopt.diagnose) and autoopt.diagnose.__name__ == "diagnose"
        assert all(hasattr(autoopt, name) for name in autoopt.__all__)
        assert autoopt.passes.PASS_NAMES and autoopt.data.prefetch
        try:
            autoopt.no_such_name
        except AttributeError:
            pass
        else:
            raise AssertionError("no AttributeError")
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr


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
    top = [line for line in lines if line.startswith("aten.")]
    assert len(top) == 5
    # Convolutions dominate a ResNet, though under load another op may time first.
    assert any("aten.conv2d.default" in line for line in top)
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


# --- what a newcomer meets: progress, options, messages ---------------------------------------

class _FakeReport:
    deferred = ""  # the forward was built at optimize (no model that generates here)

    def __str__(self) -> str:
        return "autoopt report (fake)"


def _fake_optimize(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """Replace ``autoopt.api.optimize`` with one that records its arguments, logs as the
    library does while it works, and returns a report at once."""
    seen: dict[str, Any] = {}

    def optimize(model: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
                 **options: Any) -> SimpleNamespace:
        seen.update(options, model=model, args=args)
        logging.getLogger("autoopt.compile.pass_runner").info("pass fold_batchnorm")
        logging.getLogger("autoopt.passes.packed_linear").debug("linear [4, 8]: 3 us vs 4 us")
        return SimpleNamespace(report=_FakeReport())

    monkeypatch.setattr("autoopt.api.optimize", optimize)
    return seen


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_on_a_terminal_is_a_status_line_erased_at_the_end(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    _fake_optimize(monkeypatch)
    terminal = _Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    monkeypatch.setenv("COLUMNS", "80")
    assert main(["optimize", "torch.nn:Identity", "--input", "2x3"]) == 0
    shown = terminal.getvalue()
    assert "\n" not in shown  # one line, redrawn with \r
    assert "autoopt optimize" in shown and "loading torch.nn:Identity" in shown
    assert "optimizing: capture, passes, verification" in shown
    assert "| pass packed_linear: linear" in shown  # the library's records show too
    assert max(len(line) for line in shown.split("\r")) < 80
    assert shown.endswith("\r") and shown.rsplit("\r", 2)[-2].strip() == ""  # erased
    assert capsys.readouterr().out == "autoopt report (fake)\n"


def test_the_status_line_shows_no_internal_debug_records(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """A pass's measurement is progress; another module's DEBUG record (why a graph was not
    cached, a session's temporary file) is not news to a user."""
    def optimize(model: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
                 **options: Any) -> SimpleNamespace:
        logging.getLogger("autoopt.passes.packed_linear").debug("linear [4, 8]: 3 us vs 4 us")
        logging.getLogger("autoopt.onnx.graph").debug(
            "onnxruntime: the exported graph is not cached: the exported graph holds no "
            "initializer for 'w'")
        logging.getLogger("autoopt.onnx.session").debug(
            "ONNX Runtime session for /tmp/autoopt-onnxruntime-x/graph.onnx")
        return SimpleNamespace(report=_FakeReport())

    monkeypatch.setattr("autoopt.api.optimize", optimize)
    terminal = _Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    monkeypatch.setenv("COLUMNS", "300")  # wide enough to show whole records
    assert main(["optimize", "torch.nn:Identity", "--input", "2x3"]) == 0
    shown = terminal.getvalue()
    assert "| pass packed_linear: linear" in shown
    assert "initializer" not in shown and "/tmp/" not in shown


def test_progress_with_v_is_timed_lines_and_piped_is_silent(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    _fake_optimize(monkeypatch)
    assert main(["optimize", "torch.nn:Identity", "--input", "2x3", "-v"]) == 0
    err = capsys.readouterr().err.splitlines()
    assert [line.split("] ", 1)[1] for line in err] == [
        "loading torch.nn:Identity", "optimizing: capture, passes, verification",
        "compile: pass fold_batchnorm"]
    assert all(line.startswith("[") and "s] " in line for line in err)

    assert main(["optimize", "torch.nn:Identity", "--input", "2x3"]) == 0
    assert capsys.readouterr().err == ""  # stderr is not a terminal here
    assert logging.getLogger("autoopt").handlers == []  # nothing left attached


def test_a_long_piped_command_says_now_and_then_what_it_does(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """``autoopt report`` and ``generate`` ran for minutes in silence when piped: a line now
    and then on stderr (lines, not a redrawn one), and the results alone on stdout."""
    from autoopt.observe import progress as library_progress

    monkeypatch.setattr(library_progress, "FIRST_S", 0.1)
    monkeypatch.setattr(library_progress, "EVERY_S", 0.2)

    def optimize(model: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
                 **options: Any) -> SimpleNamespace:
        logging.getLogger("autoopt.compile.pass_runner").info("pass fold_batchnorm")
        time.sleep(1.5)
        return SimpleNamespace(report=_FakeReport())

    monkeypatch.setattr("autoopt.api.optimize", optimize)
    assert main(["optimize", "torch.nn:Identity", "--input", "2x3"]) == 0
    out, err = capsys.readouterr()
    assert out == "autoopt report (fake)\n"
    lines = err.splitlines()
    assert len(lines) >= 2 and all(line.startswith("autoopt optimize: ") for line in lines)
    assert any(line.endswith(" s: pass fold_batchnorm") for line in lines), lines
    assert lines[-1].startswith("autoopt optimize: done in "), lines
    assert "\r" not in err and logging.getLogger("autoopt").handlers == []


def test_new_optimize_options_reach_the_config(monkeypatch: pytest.MonkeyPatch,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    seen = _fake_optimize(monkeypatch)
    assert main(["optimize", "torch.nn:Identity", "--input", "2x3", "--precision", "bf16",
                 "--disable", "packed_linear,onednn_conv", "--disable", "gelu"]) == 0
    config = OptimizeConfig.build(None, {k: seen[k] for k in ("precision", "disable",
                                                               "memory_budget", "verify")})
    assert config.precision == "bf16"
    assert config.disable == ("packed_linear", "onednn_conv", "gelu")
    assert config.memory_budget is None and seen["model"].training is False

    assert main(["optimize", "torch.nn:Identity", "--input", "2x3", "--train",
                 "--memory-budget", "512MiB"]) == 0
    assert seen["memory_budget"] == "512MiB" and seen["model"].training is True
    assert main(["optimize", "torch.nn:Identity", "--input", "2x3", "--train",
                 "--memory-budget", "0.5"]) == 0
    assert seen["memory_budget"] == 0.5
    assert main(["optimize", "torch.nn:Identity", "--input", "2x3", "--backends",
                 "aten,onnxruntime"]) == 0
    assert OptimizeConfig.build(None, {"backends": seen["backends"]}).candidate_backends == (
        "aten", "onnxruntime")
    assert main(["optimize", "torch.nn:Identity", "--input", "2x3", "--backend",
                 "inductor"]) == 0
    assert seen["backend"] == "inductor" and seen["backends"] is None


@pytest.mark.parametrize("argv, message", [
    (["--memory-budget", "1GiB"], "--memory-budget limits the activations saved for a training "
                                  "step; add --train"),
    (["--train", "--memory-budget", "lots"], "--memory-budget 'lots': memory_budget is bytes"),
    (["--train", "--memory-budget", "2.5"], "outside (0, 1]"),
])
def test_memory_budget_misuse(monkeypatch: pytest.MonkeyPatch,
                              capsys: pytest.CaptureFixture[str], argv: list[str],
                              message: str) -> None:
    _fake_optimize(monkeypatch)
    assert main(["optimize", "torch.nn:Identity", "--input", "2x3", *argv]) == 2
    assert message in capsys.readouterr().err


def test_disable_lists_the_passes_and_rejects_unknown_names(
        capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["optimize", "--help"])
    assert exit_.value.code == 0
    help_text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    assert ", ".join(PASS_NAMES) in help_text
    assert "-v, --verbose print each step" in help_text

    for command in (["optimize"], ["report", "-o", "r.html"]):
        with pytest.raises(SystemExit) as exit_:
            main([*command, "torch.nn:Identity", "--input", "2x3", "--disable", "fold_bn"])
        assert exit_.value.code == 2
        err = capsys.readouterr().err
        assert "unknown pass 'fold_bn'; the passes are " + ", ".join(PASS_NAMES) in err


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    from importlib.metadata import version

    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out == f"autoopt {version('autoopt')}\n"


def test_optimize_and_export_take_the_same_dynamic_values(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    seen = _fake_optimize(monkeypatch)
    assert main(["optimize", "torch.nn:Identity", "--input", "2x5:int64",
                 "--dynamic", "batch", "--dynamic", "sequence"]) == 0
    assert seen["dynamic"] is False
    assert seen["dynamic_shapes"] == {"input": {0: torch.export.Dim.DYNAMIC,
                                                1: torch.export.Dim.DYNAMIC}}
    assert main(["optimize", "torch.nn:Identity", "--input", "2x5", "--dynamic", "sequence"]) == 0
    assert seen["dynamic_shapes"] == {"input": None}  # float inputs have no sequence dimension
    assert main(["optimize", "torch.nn:Identity", "--input", "2x5", "--dynamic"]) == 0
    assert seen["dynamic"] is True and seen["dynamic_shapes"] is None
    # A batch of 1 would be fixed by export: the example is drawn with 2 (said on stdout).
    assert main(["optimize", "torch.nn:Identity", "--input", "1x5", "--dynamic", "batch"]) == 0
    assert seen["args"][0].shape == (2, 5) and "captured at 2x5" in capsys.readouterr().out

    exported: dict[str, Any] = {}
    monkeypatch.setattr("autoopt.export.onnx.export_onnx",
                        lambda *args, **kwargs: exported.update(kwargs) or "exported")
    for flags, dims_ in ((["--dynamic"], ("batch", "sequence")),
                         (["--dynamic", "all"], ("batch", "sequence")),
                         (["--dynamic", "batch", "--dynamic", "batch"], ("batch",)),
                         ([], ())):
        assert main(["export", "torch.nn:Identity", "--input", "2x5", "-o",
                     str(tmp_path / "m.onnx"), *flags]) == 0
        assert exported["dynamic"] == dims_


def test_run_prints_each_output_by_name(monkeypatch: pytest.MonkeyPatch,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    class Session:
        providers = ["CPUExecutionProvider"]
        input_names = ["x"]
        input_types = {"x": torch.float32}

        def run(self, feeds: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
            return {"output": torch.zeros(feeds["x"].shape[0], 1000)}

    monkeypatch.setattr("autoopt.onnx.session.onnx_session", lambda *args, **kwargs: Session())
    assert main(["run", "model.onnx", "--input", "8x3x4x4"]) == 0
    assert capsys.readouterr().out.splitlines() == ["providers: CPUExecutionProvider",
                                                    "output: float32[8, 1000]"]


def test_a_clone_named_autoopt_imported_from_its_parent_says_so(tmp_path: Path) -> None:
    (tmp_path / "autoopt").symlink_to(ROOT, target_is_directory=True)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run([sys.executable, "-c", "import autoopt"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    assert (f"ImportError: 'import autoopt' found {tmp_path / 'autoopt'}, the autoopt "
            f"repository, instead of the package inside it") in done.stderr
    assert "Python looked in the current folder" in done.stderr


def test_the_repository_root_read_by_path_hands_over_to_the_package(tmp_path: Path) -> None:
    """pytest reads a rootdir ``__init__.py`` as a package named after the folder, which a
    clone named autoopt makes ``autoopt``: the real package must stay behind that name."""
    script = textwrap.dedent(f"""
        import importlib.util, sys
        spec = importlib.util.spec_from_file_location("autoopt", {str(ROOT / "__init__.py")!r})
        module = importlib.util.module_from_spec(spec)
        sys.modules["autoopt"] = module
        spec.loader.exec_module(module)
        import autoopt
        print(hasattr(autoopt, "optimize"))
    """)
    done = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "True"
    assert autoopt.optimize  # and this process's package is untouched


def test_generate_compares_eager_and_autoopt_decoding(tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    source = tmp_path / "lm.py"
    source.write_text(textwrap.dedent("""
        import transformers

        def tiny_gpt2():
            config = transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=2,
                                             n_positions=32, bos_token_id=0, eos_token_id=0)
            return transformers.GPT2LMHeadModel(config)
    """))
    assert main(["generate", f"{source}:tiny_gpt2", "--prompt-len", "5", "--new", "4",
                 "--batch", "2", "--rounds", "1"]) == 0
    out = capsys.readouterr().out
    assert "prompt 5 tokens, 4 new, batch 2" in out
    assert "tokens: the same as eager" in out
    # (nan where a noisy machine timed the whole call under its first token)
    assert re.search(r"autoopt +time to first token +[\d.]+ ms +decode +([\d.]+|nan) tokens/s",
                     out)
    assert main(["generate", f"{source}:tiny_gpt2", "--new", "0"]) == 2
    assert "at least 1" in capsys.readouterr().err


def test_optimize_of_a_model_that_generates_shows_its_forward_graph(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """optimize() leaves a generating model's forward to its first call; the command, asked
    for that forward's report, builds it."""
    source = tmp_path / "lm.py"
    source.write_text(textwrap.dedent("""
        import transformers

        def tiny_gpt2():
            config = transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=2,
                                             n_positions=32, bos_token_id=0, eos_token_id=0)
            return transformers.GPT2LMHeadModel(config).eval()
    """))
    assert main(["optimize", f"{source}:tiny_gpt2", "--input", "input_ids=1x8:int64",
                 "--int-high", "64"]) == 0
    out = capsys.readouterr().out
    assert "[0] inputs:" in out and "verification: matched" in out
    assert "forward: the example call's graph is built at the first forward call" not in out
