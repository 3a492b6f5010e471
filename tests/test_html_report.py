"""The HTML report: self-contained, with its charts, from real optimize/diagnose runs."""

from __future__ import annotations

import html
import re
from dataclasses import dataclass
from html.parser import HTMLParser
from pathlib import Path

import pytest
import torch
from checks import assert_bit_identical, snapshot
from model_zoo import bert, resnet18

import autoopt
from autoopt.diagnose.collect import ReportData, collect
from autoopt.diagnose.render import render_html, write_report
from autoopt.errors import ConfigError

# Real runs are timed here: one intra-op thread, as the benchmarks use (conftest).
pytestmark = pytest.mark.usefixtures("one_thread")

_SECTIONS = ("Before / after latency", "Diagnosis: where step time goes",
             "Per-op time breakdown", "Utilization over time", "What each pass changed",
             "Precision map", "Stage partition", "Memory plan")


class _Structure(HTMLParser):
    """Counts tags and notes any attribute that would load something from elsewhere."""

    def __init__(self) -> None:
        super().__init__()
        self.tags: dict[str, int] = {}
        self.external: list[str] = []
        self.open: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags[tag] = self.tags.get(tag, 0) + 1
        for name, value in attrs:
            if name in ("src", "href", "xlink:href") and value and not value.startswith("#"):
                self.external.append(f"<{tag} {name}={value}>")


def _assert_self_contained(text: str) -> _Structure:
    assert "http://" not in text and "https://" not in text
    assert "<script" not in text and "<link" not in text and "@import" not in text
    assert not re.search(r"url\(\s*['\"]?(?!#)", text)
    parser = _Structure()
    parser.feed(text)
    assert parser.external == []
    return parser


@pytest.mark.slow
def test_bert_report_is_one_self_contained_file_with_charts(tmp_path: Path) -> None:
    model, args, kwargs = bert()
    before = snapshot(model)
    data = collect(model, args, kwargs, steps=5, repeats=5, title="bert")
    path = write_report(tmp_path / "report.html", data)
    text = path.read_text()
    parser = _assert_self_contained(text)
    assert parser.tags["svg"] >= 5  # latency, diagnosis, per-op before/after, passes, ...
    for title in _SECTIONS:
        assert f"<h2>{title}" in text, title
    # Not used in this run: the three features say so instead of drawing an empty chart.
    for title in ("Precision map", "Stage partition", "Memory plan"):
        section = text.split(f"<h2>{title}</h2>", 1)[1].split("</section>", 1)[0]
        assert "not used" in section
    assert set(data.latency_s) == {"eager", "autoopt"}
    assert all(s > 0 for s in data.latency_s.values())
    assert "MFU before" in text and "GFLOP/s peak" in text  # model FLOP utilization
    assert data.after is not None and data.after.ops
    assert "dead_code" in text and "applied" in text
    assert_bit_identical(model, before)


@pytest.mark.slow
def test_optimize_writes_the_report_when_asked(tmp_path: Path) -> None:
    model, args, kwargs = resnet18()
    target = tmp_path / "sub" / "resnet18.html"
    fast = autoopt.optimize(model, args, kwargs, report=target)
    text = target.read_text()
    _assert_self_contained(text)
    assert "fold_batchnorm" in text  # what each pass changed
    assert "conv2d" in text  # the per-op breakdown
    assert "backend (whole graph)" in text  # what executes the graph
    with torch.no_grad():
        torch.testing.assert_close(fast(*args), model(*args), rtol=1e-4, atol=1e-4)


def test_report_option_must_be_a_path() -> None:
    with pytest.raises(ConfigError, match="report is a path for the HTML report"):
        autoopt.OptimizeConfig(report=3)  # type: ignore[arg-type]


@dataclass(frozen=True)
class _Stage:
    index: int
    device: str
    compute_s: float
    transfer_s: float
    parameter_bytes: int
    activation_bytes: int


@dataclass(frozen=True)
class _Plan:
    stages: tuple[_Stage, ...]

    def table(self) -> str:
        return "stage  device  compute"


def test_features_render_as_charts_when_the_module_has_them() -> None:
    class WithPlan(torch.nn.Module):
        plan = _Plan((_Stage(0, "cpu", 1e-3, 1e-4, 2**20, 2**21),
                      _Stage(1, "cpu", 2e-3, 0.0, 2**21, 2**20)))

    text = render_html(ReportData("features", optimized=WithPlan(),
                                  latency_s={"eager": 2e-3, "autoopt": 1e-3}))
    _assert_self_contained(text)
    stage = text.split("<h2>Stage partition</h2>", 1)[1].split("</section>", 1)[0]
    assert stage.count("<svg") == 2  # per-stage time and per-stage memory
    assert "compute_s" in stage and "activation_bytes" in stage
    assert "stage  device  compute" in stage
    assert "2.00×" in text  # the speed-up card


def test_report_shows_model_flop_utilization_next_to_utilization() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    x = torch.randn(16, 64)
    before = autoopt.diagnose(model, (x,), training=True, steps=2, roofline=False)
    text = render_html(ReportData("mlp", before=before))
    _assert_self_contained(text)
    assert "MFU before" in text  # the card
    assert before.flops is not None and html.escape(before.flops.line()) in text
    assert before.utilization.summary().split(",")[0] in text  # next to the CPU/GPU figures


@pytest.mark.slow
def test_cli_report_writes_the_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from autoopt.cli import main

    target = tmp_path / "mobilenet.html"
    code = main(["report", "torchvision.models:mobilenet_v3_small", "--input", "1x3x64x64",
                 "-o", str(target), "--steps", "3", "--threads", "1"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert f"wrote {target}" in out and "top cause:" in out
    _assert_self_contained(target.read_text())
    assert main(["report", "torchvision.models:mobilenet_v3_small", "-o", str(target)]) == 2
    assert "needs --input SHAPE" in capsys.readouterr().err


def test_a_forward_not_built_yet_is_said_so_not_called_unoptimized() -> None:
    """A language model's forward graph is built at its first call (``generate`` builds its
    own): until then the passes section says that, not "not optimized"."""
    from autoopt.check.report import Report

    report = Report([])
    report.deferred = "the example call's graph is built at the first forward call"
    text = render_html(ReportData("lm", report=report))
    assert "built at the first forward call" in text and "not optimized" not in text
    assert "not optimized" in render_html(ReportData("lm", report=Report([])))
