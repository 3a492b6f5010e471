"""bench/training.py's CPU path in-process, on a tiny model: the table has a row per runner
with a step time, an MFU and a speed-up over eager; asking for CUDA without one says so."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
import training  # noqa: E402


def _tiny_cnn() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 1000))


def test_cpu_table_has_a_row_per_runner(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setitem(training.CASES, "tiny", training.Case(_tiny_cnn, full=(4, 16),
                                                              cpu=(2, 16), tokens=False))
    out = tmp_path / "training.md"
    runners = ["eager fp32", "eager autocast bf16", "autoopt fp32", "autoopt apply",
               "eager fp32 + AdamW", "autoopt apply + AdamW"]
    code = training.main(["--models", "tiny", "--runners", ",".join(runners), "--rounds", "1",
                          "--apply-models", "", "--out", str(out)])
    assert code == 0
    text = out.read_text()
    assert text.startswith("## Training step (CPU)")
    assert "python bench/training.py --models tiny" in text
    rows = [line.split(" | ") for line in text.splitlines() if line.startswith("| tiny")]
    assert [r[1] for r in rows] == runners
    assert "batch 2, 16x16" in rows[0][0]
    for cells in rows[:3]:
        assert float(cells[2]) > 0  # step ms
        assert cells[3].endswith("(fp32)") or cells[3].endswith("(bf16)")  # MFU, its dtype
        assert cells[5].endswith("×")
    assert rows[0][5] == "1.00×"
    assert rows[3][2] == "-" and rows[5][2] == "-"  # apply not asked for: rows that say so
    assert "tiny, autoopt apply: not run" in text
    assert float(rows[4][2]) > 0 and rows[4][5] == "1.00×"  # its own base
    assert "[tiny b2x16] round 1/1" in capsys.readouterr().out  # progress lines


def test_apply_with_adamw_runs_the_step_apply_kept(monkeypatch: pytest.MonkeyPatch,
                                                   tmp_path: Path) -> None:
    monkeypatch.setitem(training.CASES, "tiny", training.Case(_tiny_cnn, full=(4, 16),
                                                              cpu=(2, 16), tokens=False))
    out = tmp_path / "training.md"
    code = training.main(["--models", "tiny", "--runners", "eager fp32 + AdamW,autoopt apply "
                          "+ AdamW", "--rounds", "1", "--apply-steps", "2", "--out", str(out),
                          "--apply-models", "tiny"])
    assert code == 0
    text = out.read_text()
    rows = {line.split(" | ")[1]: line.split(" | ") for line in text.splitlines()
            if line.startswith("| tiny")}
    assert float(rows["autoopt apply + AdamW"][2]) > 0
    assert rows["autoopt apply + AdamW"][5].endswith("×")
    assert "fused optimizer (AdamW(..., fused=True)): step" in text


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message without CUDA")
def test_cuda_without_a_gpu_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    assert training.main(["--device", "cuda"]) == 2
    assert "no CUDA GPU here" in capsys.readouterr().err
