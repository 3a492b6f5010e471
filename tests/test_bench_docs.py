"""Benchmarks write their tables into docs/benchmarks.md without losing what they do not
rewrite."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
from cost_model_accuracy import write_section  # noqa: E402


def test_a_section_keeps_the_subsections_a_run_does_not_write(tmp_path: Path) -> None:
    """A 1-thread run of bench/inference.py --write replaced its whole section, the 2-thread
    table and the notes under their own headings with it."""
    doc = tmp_path / "benchmarks.md"
    doc.write_text("# Benchmarks\n\n## Inference (CPU)\n\nold intro\n\n### 1 thread\n\nold "
                   "table\n\n### 2 threads\n\ntwo\n\n### Notes\n\nkept\n\n## Other (CPU)\n\nx\n")
    write_section(doc, "## Inference (CPU)\n\nnew intro\n\n### 1 thread\n\nnew table\n")
    text = doc.read_text()
    assert "old intro" not in text and "old table" not in text
    assert text.index("new table") < text.index("### 2 threads\n\ntwo") < \
        text.index("### Notes\n\nkept") < text.index("## Other (CPU)\n\nx")
    write_section(doc, "## New (CPU)\n\nfresh\n")  # a section not there yet is appended
    assert doc.read_text().rstrip().endswith("## New (CPU)\n\nfresh")


def test_a_child_process_hands_back_its_result_or_why_it_has_none() -> None:
    import os

    import child_process

    folder = str(Path(child_process.__file__).parent)

    def child(code: str) -> list[str]:
        return [sys.executable, "-c",
                f"import sys; sys.path.insert(0, {folder!r}); import child_process; {code}"]

    env = dict(os.environ)
    assert child_process.run(child("print('noise'); child_process.report({'s': 1.5})"), env,
                             60) == {"s": 1.5}
    failed = child_process.run(child("raise SystemExit('no model named x')"), env, 60)
    assert failed == {"error": "exit 1: no model named x"}
    assert child_process.run(child("import time; time.sleep(5)"), env, 0.5) == {
        "error": "stopped after 0 s"}
