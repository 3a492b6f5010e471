"""Progress of long library calls on stderr, where logging shows nothing
(autoopt.observe.progress)."""

from __future__ import annotations

import logging
import time
from typing import Any

import pytest
import torch
from torch import nn

import autoopt
from autoopt.observe import progress


class _Slow(nn.Module):
    """A forward that takes a while: each of optimize's eager runs sleeps."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(0.05)
        return self.linear(x)


@pytest.fixture
def quick(monkeypatch: pytest.MonkeyPatch) -> None:
    """Lines after a tenth of a second instead of seconds; progress on (the suite turns it
    off, see conftest)."""
    monkeypatch.setenv("AUTOOPT_PROGRESS", "1")
    monkeypatch.setattr(progress, "FIRST_S", 0.1)
    monkeypatch.setattr(progress, "EVERY_S", 0.2)


def _optimize() -> Any:
    with torch.no_grad():
        return autoopt.optimize(_Slow().eval(), (torch.randn(2, 4),), backends=("aten",))


def test_a_long_optimize_says_what_it_does_and_puts_logging_back(
        quick: None, capfd: pytest.CaptureFixture[str]) -> None:
    library = logging.getLogger("autoopt")
    before = (library.level, library.propagate, list(library.handlers))
    _optimize()
    err = capfd.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("autoopt optimize: ")]
    assert len(lines) >= 2 and lines[-1].startswith("autoopt optimize: done in "), err
    assert any(" s: " in line for line in lines[:-1]), lines
    assert (library.level, library.propagate, list(library.handlers)) == before


def test_nothing_is_shown_where_logging_shows_autoopt_or_it_is_turned_off(
        quick: None, capfd: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    handler = logging.NullHandler()
    library = logging.getLogger("autoopt")
    library.addHandler(handler)  # the user's own (the command line adds one too)
    try:
        _optimize()
    finally:
        library.removeHandler(handler)
    monkeypatch.setenv("AUTOOPT_PROGRESS", "0")
    _optimize()
    assert "autoopt optimize:" not in capfd.readouterr().err


def test_warnings_reach_the_handlers_they_reached_before(
        quick: None, caplog: pytest.LogCaptureFixture) -> None:
    """The call takes autoopt's records for its line; a warning logged meanwhile still
    reaches the root's handlers (here pytest's)."""
    with caplog.at_level(logging.WARNING), progress.reported("optimize"):
        logging.getLogger("autoopt.test").warning("a warning during the call")
        logging.getLogger("autoopt.test").info("not a warning")
    assert [r.getMessage() for r in caplog.records if r.name == "autoopt.test"] == [
        "a warning during the call"]


def test_the_first_call_of_new_inputs_says_what_it_does(
        quick: None, capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """The Quick start's ``fast(torch.randn(4, 3, 224, 224))`` captured for 79 s in
    silence: a call that captures new inputs reports like optimize."""
    monkeypatch.setenv("AUTOOPT_PROGRESS", "0")
    fast = _optimize()
    capfd.readouterr()
    monkeypatch.setenv("AUTOOPT_PROGRESS", "1")
    with torch.no_grad():
        fast(torch.randn(3, 4))  # another batch size: a new capture
    lines = [line for line in capfd.readouterr().err.splitlines()
             if line.startswith("autoopt call: capturing new inputs: ")]
    assert len(lines) >= 2 and lines[-1].endswith(" s") and "done in" in lines[-1], lines


def test_diagnosis_apply_says_what_it_does(quick: None, capfd: pytest.CaptureFixture[str],
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """``Diagnosis.apply()`` ran for 307 s in silence."""
    monkeypatch.setenv("AUTOOPT_PROGRESS", "0")
    diagnosis = autoopt.diagnose(_Slow().eval(), torch.randn(2, 4), steps=2, roofline=False,
                                 warmup=0, profile_steps=1)
    capfd.readouterr()
    monkeypatch.setenv("AUTOOPT_PROGRESS", "1")
    diagnosis.apply(verify=False, backends=("aten",))
    lines = [line for line in capfd.readouterr().err.splitlines()
             if line.startswith("autoopt Diagnosis.apply: ")]
    assert lines and "done in" in lines[-1], lines
    # What it was doing when a line came (on a fast machine, only the first stage lasts one).
    assert all(any(word in line for word in ("timed steps", "optimize", "warm-up", "steps"))
               for line in lines[:-1]), lines


def test_a_call_that_raises_is_not_done(quick: None, capfd: pytest.CaptureFixture[str]) -> None:
    class _Fails(_Slow):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            time.sleep(0.5)
            raise ValueError("no")

    with pytest.raises(Exception, match="no"):
        autoopt.optimize(_Fails().eval(), (torch.randn(2, 4),), backends=("aten",))
    lines = [line for line in capfd.readouterr().err.splitlines()
             if line.startswith("autoopt optimize: ")]
    assert lines and not any("done in" in line for line in lines), lines
