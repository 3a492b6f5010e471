"""Re-captures a real loop pays: a call with gradients on a model optimized for inference, a
validation call after each optimizer step, a new sequence length. Each is correct either way;
these tests hold that the work is not done again (no second ``torch.export``, no capture per
validation, no capture per length) and that the results still match eager's."""

from __future__ import annotations

import copy
import logging
from collections.abc import Iterator

import pytest
import torch
from torch import nn

import autoopt


class ConvBnNet(nn.Module):
    """A convolution with BatchNorm (folded in an inference graph) and a linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3)
        self.bn = nn.BatchNorm2d(8)
        self.head = nn.Linear(8 * 10 * 10, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.bn(self.conv(x))).flatten(1))


def _net() -> ConvBnNet:
    torch.manual_seed(0)
    model = ConvBnNet()
    with torch.no_grad():  # statistics that are not the identity, so folding them matters
        model.bn.running_mean.uniform_(-0.5, 0.5)
        model.bn.running_var.uniform_(0.5, 2.0)
        model.bn.weight.uniform_(0.5, 1.5)
    return model


@pytest.fixture
def exports(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[object]]:
    """Every ``torch.export.export`` call made while the test runs."""
    calls: list[object] = []
    real = torch.export.export

    def counting(*args: object, **kwargs: object) -> object:
        calls.append(args[0])
        return real(*args, **kwargs)

    monkeypatch.setattr(torch.export, "export", counting)
    yield calls


def _close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(actual, expected, rtol=1e-4, atol=1e-5)


def test_a_call_with_gradients_on_an_eval_model_says_so_and_exports_nothing(
        exports: list[object], caplog: pytest.LogCaptureFixture) -> None:
    """``fast = optimize(model.eval(), (x,))`` then ``fast(x)`` without ``no_grad``, as
    ``torch.compile`` users write it: the call needs a graph that keeps gradients, built from
    the graph already exported, and a log line says what is built and how to avoid it."""
    model = _net().eval()
    twin = copy.deepcopy(model)
    x = torch.randn(2, 3, 12, 12)
    fast = autoopt.optimize(model, (x,))
    assert len(exports) == 1
    with caplog.at_level(logging.WARNING, logger="autoopt"):
        y = fast(x)
    assert len(exports) == 1  # no second export
    assert len(fast.report.captures) == 2
    assert fast.report.captures[1].reused.startswith("the graph exported for [0]")
    said = " ".join(r.getMessage() for r in caplog.records)
    assert "gradients" in said and "torch.no_grad()" in said
    # The gradient graph is the model's function, gradients included.
    expected = twin(x)
    _close(y, expected)
    y.square().sum().backward()
    expected.square().sum().backward()
    for (name, p), q in zip(fast.module.named_parameters(), twin.parameters(), strict=True):
        assert p.grad is not None, name
        _close(p.grad, q.grad)
    # Inference calls still run the inference graph; the gradient graph serves later calls.
    with torch.no_grad():
        _close(fast(x), twin(x))
    fast(x)
    assert len(fast.report.captures) == 2 and len(exports) == 1


def test_validation_after_each_optimizer_step_rebuilds_without_a_capture(
        exports: list[object]) -> None:
    """train, step, eval, a ``no_grad`` validation call, round after round: the inference
    graph folded BatchNorm and packed the weights, so each step makes it stale, but it is
    rebuilt from its exported graph (the passes run again, no export, no new capture in the
    report), and each validation matches eager with the trained weights."""
    model = _net()
    twin = copy.deepcopy(model)
    x, v = torch.randn(4, 3, 12, 12), torch.randn(4, 3, 12, 12)
    fast = autoopt.optimize(model, (x,))
    fast_opt = torch.optim.SGD(fast.parameters(), lr=0.05, momentum=0.9)
    twin_opt = torch.optim.SGD(twin.parameters(), lr=0.05, momentum=0.9)
    captures = exported = -1
    for step in range(4):
        for net, opt in ((fast, fast_opt), (twin, twin_opt)):
            net.train()
            opt.zero_grad()
            net(x).square().mean().backward()
            opt.step()
            net.eval()
        with torch.no_grad():
            _close(fast(v), twin(v))
            _close(fast(v), twin(v))
        if step == 0:  # the first validation captures the inference graph
            captures, exported = len(fast.report.captures), len(exports)
        assert (len(fast.report.captures), len(exports)) == (captures, exported), step
    inference = fast.report.captures[-1]
    assert inference.rebuilds == 3
    with torch.no_grad():  # the rebuilt graph is still optimized: BatchNorm folded
        graph = fast.graph_for((v,))
    assert graph is not None
    assert not any("batch_norm" in str(n.target) for n in graph.graph.nodes)
    assert "rebuilt 3 time(s)" in str(fast.report)


def test_a_rebuilt_graph_sees_every_kind_of_weight_write(exports: list[object]) -> None:
    """In-place, through ``.data`` and by ``load_state_dict``: each is rebuilt, not
    exported again, and computes with the new values."""
    model = _net().eval()
    x = torch.randn(2, 3, 12, 12)
    with torch.no_grad():
        fast = autoopt.optimize(model, (x,))
        twin = copy.deepcopy(fast.module)
        for write in (lambda m: m.conv.weight.mul_(-1), lambda m: m.bn.running_var.mul_(3),
                      lambda m: m.head.weight.data.mul_(0.5),
                      lambda m: m.load_state_dict(_other_state())):
            write(fast.module)
            write(twin)
            _close(fast(x), twin(x))
    assert len(exports) == 1 and len(fast.report.captures) == 1
    assert fast.report.captures[0].rebuilds == 4


def _other_state() -> dict[str, torch.Tensor]:
    torch.manual_seed(1)
    return ConvBnNet().state_dict()


# --- new sizes -------------------------------------------------------------------------------


def _llama() -> nn.Module:
    import transformers

    config = transformers.LlamaConfig(vocab_size=128, hidden_size=32, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1,
                                      intermediate_size=64, max_position_embeddings=64)
    torch.manual_seed(0)
    return transformers.LlamaModel(config).train()


def _ids(length: int) -> torch.Tensor:
    return torch.randint(0, 128, (2, length))


def _train_step(model: nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    out = model(ids, attention_mask=torch.ones_like(ids)).last_hidden_state
    params = [p for p in model.parameters() if p.requires_grad]
    grads = torch.autograd.grad(out.square().mean(), params)
    return out.detach(), list(grads)


def test_dynamic_training_with_a_memory_budget_is_one_graph_for_every_length() -> None:
    """``dynamic=True`` with ``memory_budget``: the plan priced its peak by comparing
    symbolic byte counts, each comparison a guard on the graph, so lengths 16, 9, 23 took
    two graphs where ``dynamic=True`` alone takes one."""
    model = _llama()
    twin = copy.deepcopy(model)
    ids = _ids(16)
    fast = autoopt.optimize(model, (ids,), {"attention_mask": torch.ones_like(ids)},
                            dynamic=True, memory_budget=0.5)
    assert fast.report.captures[0].memory_plan is not None
    _trains_like(fast, twin, (16, 9, 23))
    assert len(fast.report.captures) == 1, fast.report


def _trains_like(fast: nn.Module, twin: nn.Module, lengths: tuple[int, ...]) -> None:
    """A training step at each sequence length: outputs and gradients are the twin's."""
    for length in lengths:
        ids = _ids(length)
        out, grads = _train_step(fast, ids)
        expected, expected_grads = _train_step(twin, ids)
        _close(out, expected)
        for g, e in zip(grads, expected_grads, strict=True):
            _close(g, e)


def test_a_second_length_makes_that_dimension_dynamic(exports: list[object]) -> None:
    """Without ``dynamic=``: the first graph has the example's sizes; the first call with
    another length is captured with the sequence dimension dynamic (``torch.compile``'s
    rule), and every later length runs that graph. Training, gradients checked."""
    model = _llama()
    twin = copy.deepcopy(model)
    ids = _ids(16)
    fast = autoopt.optimize(model, (ids,), {"attention_mask": torch.ones_like(ids)})
    _trains_like(fast, twin, (16, 9, 23, 12, 5))
    assert len(fast.report.captures) == len(exports) == 2, fast.report
    first, second = (s.signature for s in fast.specializations)
    assert first is not None and second is not None
    assert None not in first.leaves[0].shape  # the example's graph: static
    assert second.leaves[0].shape == (2, None)  # the batch never changed: still static


def test_a_dimension_made_dynamic_stays_dynamic_when_another_varies(
        exports: list[object]) -> None:
    """Batch and length both vary: once the length is dynamic, a new batch size is captured
    with both dimensions dynamic, not with the length fixed again (``[?, 30]``, then
    ``[3, ?]``: a graph per call until ``max_specializations`` ran out)."""
    model = _llama().eval()
    with torch.no_grad():
        fast = autoopt.optimize(model, (_ids(16),), backend="aten")
        for batch, length in ((2, 12), (3, 30), (3, 7), (4, 9), (5, 11)):
            ids = torch.randint(0, 128, (batch, length))
            _close(fast(ids).last_hidden_state, model(ids).last_hidden_state)
    assert len(fast.report.captures) == len(exports) == 3, fast.report
    shapes = [s.signature.leaves[0].shape for s in fast.specializations
              if s.signature is not None]
    assert shapes == [(2, 16), (2, None), (None, None)]


def test_dynamic_false_keeps_a_graph_per_size() -> None:
    model = nn.Sequential(nn.Linear(6, 12), nn.GELU(), nn.Linear(12, 3)).eval()
    with torch.no_grad():
        fast = autoopt.optimize(model, (torch.randn(1, 6),), dynamic=False)
        for batch in (2, 3):
            x = torch.randn(batch, 6)
            _close(fast(x), model(x))
    assert len(fast.report.captures) == 3
    assert all(None not in s.signature.leaves[0].shape for s in fast.specializations
               if s.signature is not None)


def test_the_train_and_validate_bench_rebuilds_and_captures_nothing_after_the_first(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """bench/training.py --validate on a tiny CNN: autoopt captures the training graph and
    the inference graph once, and rebuilds the inference graph at every later validation."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
    import training

    def tiny() -> nn.Module:
        return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                             nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 1000))

    monkeypatch.setitem(training.CASES, "tiny", training.Case(tiny, full=(2, 8), cpu=(2, 8),
                                                              tokens=False))
    eager, fast = training.validate_loop("tiny", 2, 8, 3, 2, torch.device("cpu"))
    assert (eager.runner, fast.runner) == ("eager fp32", "autoopt fp32")
    assert (fast.captures, fast.rebuilds) == (2, 2)
    assert fast.later_s > 0 and eager.later_s > 0
    text = training.validation_table([eager, fast], {"tiny": (2, 8)}, 1, "cmd", 3, 2,
                                     torch.device("cpu"), "load")
    assert "| tiny (batch 2, 8) | autoopt fp32 |" in text
