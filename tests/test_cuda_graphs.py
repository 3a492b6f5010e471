"""CUDA-graph replay: where it does not apply it says why, and nothing changes (the replay
itself is tested on a GPU in test_gpu.py)."""

from __future__ import annotations

import torch
from torch import nn

import autoopt
from autoopt.runtime import cuda_graphs


def test_cpu_inputs_are_not_recorded_and_the_reason_is_given() -> None:
    fn = nn.Linear(4, 2).eval()
    with torch.no_grad():
        runner, why = cuda_graphs.record(fn, (torch.randn(3, 4),), {})
    assert runner is fn and "one CUDA device" in why and "cpu" in why


def test_training_calls_are_not_recorded() -> None:
    fn = nn.Linear(4, 2)
    runner, why = cuda_graphs.record(fn, (torch.randn(3, 4),), {})
    assert runner is fn and "gradients are enabled" in why


def test_cpu_optimize_leaves_the_report_silent_about_cuda_graphs() -> None:
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU()).eval()
    fast = autoopt.optimize(model, (torch.randn(2, 4),))
    assert fast.report.captures[0].cuda_graph == ""
    assert "cuda graph" not in str(fast.report)
