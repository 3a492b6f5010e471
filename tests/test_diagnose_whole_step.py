"""Whole-step remedies of ``Diagnosis.apply()``: the optimizer's update fused (CPU and CUDA),
TF32, cuDNN benchmark and a CUDA graph of the whole training step (CUDA), each kept only when
its measured step is faster and reported either way. Times are reported, never asserted."""

from __future__ import annotations

import copy
import re
from collections.abc import Callable

import pytest
import torch
from checks import assert_bit_identical, snapshot
from torch import nn

import autoopt
from autoopt.diagnose.whole_step import (
    StepOptions,
    backend_settings,
    copy_optimizer,
    fused_overrides,
    settings_off,
)
from autoopt.diagnose.workload import Workload
from autoopt.errors import ConfigError

pytestmark = pytest.mark.usefixtures("one_thread")


def _mlp() -> nn.Module:
    """Linear(32, 64) ─ GELU ─ Linear(64, 8)."""
    return nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 8))


def _loss(out: torch.Tensor, _batch: object) -> torch.Tensor:
    return out.square().mean()


OPTIMIZERS: dict[str, Callable[[nn.Module], torch.optim.Optimizer]] = {
    "Adam": lambda m: torch.optim.Adam(m.parameters(), lr=1e-2),
    "AdamW": lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1),
    "SGD momentum": lambda m: torch.optim.SGD(m.parameters(), lr=1e-2, momentum=0.9),
}


def _train(model: nn.Module, optimizer: torch.optim.Optimizer, steps: int) -> None:
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.randn(16, 32, generator=gen, device=next(model.parameters()).device)
        _loss(model(x), None).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def _optimizer_state(optimizer: torch.optim.Optimizer) -> dict[str, object]:
    state = copy.deepcopy(optimizer.state_dict())
    return {"groups": state["param_groups"], "state": state["state"]}


def _assert_same_state(a: dict[str, object], b: dict[str, object]) -> None:
    assert a["groups"] == b["groups"]
    torch.testing.assert_close(a["state"], b["state"], rtol=0, atol=0)


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_fused_copy_of_an_optimizer_trains_like_it_and_leaves_it_untouched(name: str) -> None:
    model = _mlp()
    optimizer = OPTIMIZERS[name](model)
    _train(model, optimizer, 2)  # state to copy: moments, momentum buffers, step counts
    before, state = snapshot(model), _optimizer_state(optimizer)
    overrides, what = fused_overrides(optimizer, model)
    assert what == "fused" and overrides["fused"] is True  # Adam, AdamW, SGD fuse on CPU
    reference, fused_model = copy.deepcopy(model), copy.deepcopy(model)
    reference_opt = copy_optimizer(optimizer, model, reference)
    fused = copy_optimizer(optimizer, model, fused_model, **overrides)
    assert all(g["fused"] for g in fused.param_groups)
    assert not any(g["fused"] for g in reference_opt.param_groups)
    assert fused.param_groups[0]["lr"] == optimizer.param_groups[0]["lr"]
    _train(reference, reference_opt, 5)
    _train(fused_model, fused, 5)
    for (n, p), q in zip(reference.named_parameters(), fused_model.parameters(), strict=True):
        torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-6, msg=n)
    assert_bit_identical(model, before)  # yours: neither the model ...
    _assert_same_state(_optimizer_state(optimizer), state)  # ... nor its optimizer moved
    assert not any(g.get("fused") for g in optimizer.param_groups)


def test_fused_overrides_say_why_not() -> None:
    model = _mlp()
    fused = torch.optim.Adam(model.parameters(), fused=True)
    assert fused_overrides(fused, model) == ({}, "Adam is fused already (fused=True)")
    differentiable = torch.optim.SGD(model.parameters(), lr=0.1, differentiable=True)
    assert "differentiable" in fused_overrides(differentiable, model)[1]
    # RMSprop has no fused kernel: its multi-tensor (foreach) update is the fused one.
    assert fused_overrides(torch.optim.RMSprop(model.parameters()), model) == (
        {"foreach": True}, "foreach")
    other = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)
    with pytest.raises(ConfigError, match="not parameters of the model"):
        copy_optimizer(other, model, copy.deepcopy(model))


def _backend_flags() -> tuple[object, ...]:
    """cuDNN benchmark and the TF32 settings, through the API this torch has (torch refuses to
    read the legacy ``allow_tf32`` after the new ``fp32_precision`` set it)."""
    backends = torch.backends
    if hasattr(backends.cuda.matmul, "fp32_precision"):
        return (backends.cudnn.benchmark, backends.cuda.matmul.fp32_precision,
                backends.cudnn.conv.fp32_precision)
    return (backends.cudnn.benchmark, backends.cuda.matmul.allow_tf32,
            backends.cudnn.allow_tf32)


def test_backend_settings_are_set_for_the_block_and_put_back() -> None:
    flags = _backend_flags()
    with pytest.raises(RuntimeError, match="inside"):
        with backend_settings(StepOptions(tf32=True, cudnn_benchmark=True)):
            assert settings_off(torch.device("cuda")) == []  # TF32 and cuDNN benchmark on
            raise RuntimeError("inside")
    assert _backend_flags() == flags


def test_diagnose_runs_the_optimizer_s_update_on_copies() -> None:
    model = _mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    before, state = snapshot(model), _optimizer_state(optimizer)
    x = torch.randn(16, 32)
    w = Workload(model, (x,), None, None, True, None, _loss, optimizer)
    with w.running():
        feed = w.batches()
        w.step(feed)
    assert w.optimizer is not None and w.optimizer is not optimizer
    moved = [not torch.equal(p, q) for p, q in zip(model.parameters(), w.model.parameters(),
                                                     strict=True)]
    assert all(moved)  # the copy took a step ...
    assert_bit_identical(model, before)  # ... yours did not
    _assert_same_state(_optimizer_state(optimizer), state)
    with pytest.raises(ConfigError, match="optimizer= is for training=True"):
        autoopt.diagnose(model, (x,), optimizer=optimizer)


def test_apply_tries_the_fused_optimizer_and_reports_it() -> None:
    model = _mlp()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    _train(model, optimizer, 1)
    before, state = snapshot(model), _optimizer_state(optimizer)
    x = torch.randn(16, 32)
    d = autoopt.diagnose(model, (x,), training=True, steps=3, roofline=False,
                         loss_fn=_loss, optimizer=optimizer)
    assert "the optimizer's update is not fused (AdamW without fused=True): apply() tries it" \
        in d.notes, d.notes
    result = d.apply(steps=3)
    line = next(n for n in result.notes if n.startswith("fused optimizer"))
    match = re.fullmatch(r"fused optimizer \(AdamW\(\.\.\., fused=True\)\): step ([\d.]+) ms "
                         r"with, ([\d.]+) ms without \(compute, median\); (kept|not kept)", line)
    assert match is not None, line
    kept = match[3] == "kept"
    assert ("fused optimizer" in result.applied) == kept
    assert result.step_options.optimizer == ("fused" if kept else "")
    assert any(n.startswith("TF32, cuDNN benchmark, CUDA graph of the step: not tried: CUDA "
                            "only") for n in result.notes), result.notes
    # A new optimizer over the optimized module's parameters, yours as it was at diagnose.
    new = result.optimizer
    assert isinstance(new, torch.optim.AdamW) and new is not optimizer
    assert all(bool(g["fused"]) == kept for g in new.param_groups)  # None: AdamW's default
    ids = {id(p) for p in result.optimized.parameters()}
    assert all(id(p) in ids for g in new.param_groups for p in g["params"])
    implementation = {"fused": None, "foreach": None}  # the one thing that may differ
    _assert_same_state({"groups": [{**g, **implementation} for g in
                                   copy.deepcopy(new.state_dict())["param_groups"]],
                        "state": new.state_dict()["state"]},
                       {"groups": [{**g, **implementation} for g in state["groups"]],
                        "state": state["state"]})
    assert_bit_identical(model, before)
    _assert_same_state(_optimizer_state(optimizer), state)
    # optimized starts from your parameters, not from those the diagnosis's steps moved.
    for p, q in zip(model.parameters(), result.optimized.parameters(), strict=True):
        assert torch.equal(p, q)


def test_apply_without_an_optimizer_says_so() -> None:
    d = autoopt.diagnose(_mlp(), (torch.randn(16, 32),), training=True, steps=2,
                         roofline=False, loss_fn=_loss)
    result = d.apply(steps=2)
    assert result.optimizer is None and result.step_options == StepOptions()
    assert any("fused optimizer: not tried: no optimizer" in n for n in result.notes)


@pytest.mark.gpu
def test_a_cuda_graph_of_the_whole_step_trains_like_the_eager_step() -> None:
    torch.manual_seed(0)
    model = _mlp().cuda()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    x = torch.randn(16, 32, device="cuda")
    runs = [Workload(model, (x,), None, None, True, None, _loss, optimizer,
                     StepOptions(cuda_graph=graph)) for graph in (False, True)]
    for w in runs:
        with w.running():
            feed = w.batches()
            for _ in range(6):
                w.step(feed)
    eager, graphed = runs
    assert graphed._graphed is not None and graphed.graph_misses == 0
    # The graph's recording ran three warm-up steps before it, so compare after as many.
    with eager.running():
        feed = eager.batches()
        for _ in range(3):
            eager.step(feed)
    for p, q in zip(eager.model.parameters(), graphed.model.parameters(), strict=True):
        torch.testing.assert_close(q, p, rtol=1e-4, atol=1e-5)


@pytest.mark.gpu
def test_apply_on_cuda_tries_tf32_cudnn_benchmark_and_a_cuda_graph() -> None:
    flags = _backend_flags()
    torch.backends.cudnn.benchmark = False
    off = settings_off(torch.device("cuda"))  # TF32 is off by default; another test may set it
    try:
        model = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.Flatten(),
                              nn.Linear(16 * 16 * 16, 10)).cuda()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        x = torch.randn(8, 3, 16, 16, device="cuda")
        d = autoopt.diagnose(model, (x,), training=True, steps=3, roofline=False,
                             loss_fn=_loss, optimizer=optimizer)
        result = d.apply(steps=3)
        for remedy in ("fused optimizer", "TF32", "cuDNN benchmark", "CUDA graph of the step"):
            line = next((n for n in result.notes if n.startswith(remedy)), None)
            assert line is not None and re.search(r"(kept|not applied: .+)$", line) or (
                remedy == "TF32" and "tf32" not in off), (remedy, result.notes)
        # Process-wide settings were set for the diagnosis's steps only.
        assert settings_off(torch.device("cuda")) == off
    finally:
        torch.backends.cudnn.benchmark = flags[0]
    assert _backend_flags() == flags
