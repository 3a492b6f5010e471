"""bench/inference.py's table: the load each row ran under, and rows measured while the
machine was shared marked as such (issue 49)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
import inference  # noqa: E402


def _row(model: str, load: float | None) -> dict:
    row = {"model": model, "batch": 1, "flops": 4e9, "scale": 1.0, "ort_ratio": None,
           "median": {"eager": 0.050, "autoopt": 0.025, "torch.compile": 0.030,
                      "onnxruntime": 0.028, "openvino": 0.027},
           "prepare": {"autoopt": 3.0, "torch.compile": 9.0}, "memory": {"autoopt": 10.0},
           "errors": {"autoopt": 1e-6}, "failures": {}, "backends": {}}
    if load is not None:
        row["load"] = load
    return row


def test_each_row_shows_its_load_and_a_shared_one_is_marked() -> None:
    text = inference.table([_row("quiet", 1.1), _row("busy", 2.3), _row("old", None)],
                           threads=1)
    lines = [line for line in text.splitlines() if line.startswith("|")]
    header, rule, *rows = lines
    assert header.rstrip(" |").endswith("load")
    columns = header.count("|")
    assert rule.count("|") == columns and all(r.count("|") == columns for r in rows), lines
    quiet, busy, old = rows
    assert quiet.endswith("| 1.10 |") and busy.endswith("| 2.30 (shared) |")
    assert old.endswith("| — |")  # a row from before the column
    # At two threads the bench's own two make a load of 2: not shared.
    two = inference.table([_row("two", 2.3)], threads=2)
    assert "2.30 |" in two and "shared" not in two
