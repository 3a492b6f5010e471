"""bench/decode_quality.py: the trained model is cached and read back whole, its evaluation
windows lie in text it never trained on, and each runner's scores are what its logits say."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import decode_quality as quality  # noqa: E402

# The text it trains on ships with CPython; a distribution may leave it out.
pytest.importorskip("pydoc_data.topics", reason="this Python was installed without pydoc_data")


def test_the_evaluation_windows_are_from_the_held_out_tail() -> None:
    text = quality.corpus()
    cut = int(len(text) * (1 - quality.HELD_OUT))
    spans = quality.windows(5, prompt=16, new=8)
    assert len(spans) == 5 and all(w.shape == (1, 24) for w in spans)
    held = text[cut:]
    found = [bytes(w[0].tolist()) for w in spans]
    assert all(f in held for f in found)
    assert len(set(found)) == len(found)  # spread out, none twice
    assert quality.corpus() == text  # the same text each time


def test_the_trained_model_is_cached_and_read_back(tmp_path: Path) -> None:
    messages: list[str] = []
    model, first = quality.trained(3, tmp_path, messages.append)
    again, second = quality.trained(3, tmp_path, messages.append)
    assert not first["cached"] and second["cached"]
    assert first["steps"] == 3 and math.isfinite(first["last_loss"])
    assert any("read from" in m for m in messages)
    for (name, a), (_, b) in zip(model.state_dict().items(), again.state_dict().items(),
                                 strict=True):
        assert torch.equal(a, b), name
    assert not again.training


def test_scores_read_the_logits() -> None:
    targets = torch.tensor([1, 2, 3])
    uniform = torch.zeros(3, 8)
    found = quality.scores(uniform, uniform, targets)
    assert found["perplexity"] == pytest.approx(8.0)  # uniform over 8: perplexity 8
    assert found["error"] == 0.0
    reference = torch.zeros(3, 8)
    reference[torch.arange(3), targets] = 5.0
    sure = quality.scores(reference, reference, targets)
    assert sure["perplexity"] < 1.1 and sure["agreement"] == 1.0
    one_off = reference.clone()
    one_off[0, 1], one_off[0, 7] = 0.0, 5.0
    off = quality.scores(one_off, reference, targets)
    assert off["agreement"] == pytest.approx(2 / 3)
    assert off["error"] == 5.0
    assert off["perplexity"] > sure["perplexity"]


def test_a_runner_is_scored_on_its_own_decode_steps(tmp_path: Path) -> None:
    """autoopt's int8 block kernel and the fp32 graphs decode every window teacher-forced: fp32
    agrees with eager on every step within float rounding; a kernel this machine cannot run
    is a row that says why."""
    model, _ = quality.trained(2, tmp_path, lambda _: None)
    rows = quality.measure(model, count=2, prompt=16, new=6, threads=1, llama_cpp=False,
                           log=lambda _: None,
                           rows=(("fp32", None), ("int8", "int8_blocks")))
    by = {r["runner"]: r for r in rows}
    eager, fp32 = by["eager fp32"], by["autoopt fp32"]
    assert eager["agreement"] == 1.0 and eager["error"] == 0.0
    assert fp32["agreement"] == 1.0 and fp32["error"] < 1e-3
    assert fp32["perplexity"] == pytest.approx(eager["perplexity"], rel=1e-4)
    blocks = by["autoopt int8 (int8_blocks)"]
    if "failed" in blocks:
        assert blocks["failed"].startswith("refused:")
    else:
        assert 0 < blocks["error"] < 0.5
        assert blocks["perplexity"] == pytest.approx(eager["perplexity"], rel=0.05)
    assert by["llama.cpp Q4_0"]["failed"] == "skipped: --no-llama-cpp"
    table = quality.table(rows, {"steps": 2, "first_loss": 5.6, "last_loss": 5.0,
                                 "seconds": 1.0}, "cmd", 1, 2, 16, 6)
    assert table.count("\n| ") == len(rows) + 1  # the header and a line per runner
