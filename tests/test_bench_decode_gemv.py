"""bench/decode_gemv.py: each kernel packed_linear chooses among for a decode step's GEMV,
timed on the same weights, and a table that names the fastest."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import decode_gemv  # noqa: E402

from autoopt.passes import block_kernels  # noqa: E402
from autoopt.passes.packed_kernels import OWN_GEMV, kernels, kernels_for  # noqa: E402


def test_every_kernel_of_each_dtype_is_timed_and_the_fastest_named() -> None:
    threads = torch.get_num_threads()
    try:
        rows, bytes_per_s = decode_gemv.run(1, rounds=2, sweep_mib=4,
                                            shapes=[("small", 96, 64), ("wide", 40, 200)])
    finally:
        torch.set_num_threads(threads)
    assert bytes_per_s > 0 and len(rows) == 4
    own = block_kernels.unavailable() is None
    for _, _, _, dtype, speeds, load in rows:
        assert load >= 0
        expected = {"aten"} | {k for k in kernels(torch.device("cpu"))
                               if k in kernels_for(dtype)
                               and (own or k not in OWN_GEMV)}
        assert set(speeds) == expected, dtype
        assert all(v > 0 for v in speeds.values())
    text = decode_gemv.table(rows, bytes_per_s)
    lines = text.splitlines()
    assert len(lines) == 2 + len(rows)
    for line, (_, _, _, _, speeds, load) in zip(lines[2:], rows, strict=True):
        assert f"| {max(speeds, key=speeds.__getitem__)} |" in line
        assert line.endswith(f" | {load:.2f} |")
