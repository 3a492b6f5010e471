"""Training under a memory budget: the offload runtime (host as both ends on this CPU), and
``optimize(..., training=True, memory_budget=...)`` on real models giving eager's loss and
gradients while the saved activations, counted through saved-tensor hooks, fit the budget."""

from __future__ import annotations

import copy
import gc
from typing import Any

import pytest
import torch
from model_zoo import gpt2, resnet18
from torch import nn
from torch.utils import _pytree as pytree

import autoopt
from autoopt.capture.graph import export_graph, flat_example_inputs
from autoopt.planning.activations import profile_activations
from autoopt.planning.memory_plan import MemoryPlan
from autoopt.planning.segments import KEEP, MODES, OFFLOAD, RECOMPUTE, SELECTIVE
from autoopt.runtime.offload import Offload, Offloader
from autoopt.runtime.recompute import apply_plan


def _mlp() -> tuple[nn.Module, tuple[Any, ...], dict[str, Any]]:
    blocks = [nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.Dropout(0.1), nn.Linear(128, 32),
                            nn.LayerNorm(32)) for _ in range(4)]
    return nn.Sequential(*blocks, nn.Linear(32, 4)), (torch.randn(16, 32),), {}


class _SmallCNN(nn.Module):
    """Conv, BatchNorm (training statistics), ReLU, a residual block, pooling, a classifier."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU())
        self.block = nn.Sequential(nn.Conv2d(16, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                                   nn.Conv2d(16, 16, 3, padding=1), nn.BatchNorm2d(16))
        self.down = nn.Sequential(nn.Conv2d(16, 32, 3, stride=2, padding=1), nn.ReLU())
        self.head = nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)  # (B, 16, H, W)
        x = torch.relu(x + self.block(x))
        x = self.down(x)  # (B, 32, H/2, W/2)
        return self.head(x.mean((2, 3)))


def _cnn() -> tuple[nn.Module, tuple[Any, ...], dict[str, Any]]:
    return _SmallCNN(), (torch.randn(2, 3, 16, 16),), {}


def _transformer() -> tuple[nn.Module, tuple[Any, ...], dict[str, Any]]:
    # Dropout 0.1 in train mode: a recomputed segment must draw the same masks again.
    model, args, kwargs = gpt2()
    model.config.use_cache = False  # a training step returns no key/value cache
    return model, args, kwargs


MODELS = {"mlp": _mlp, "cnn": _cnn, "transformer": _transformer}


class _SavedCounter(torch.autograd.graph.saved_tensors_hooks):
    """Bytes of distinct storages autograd saves on the device, parameters excluded. Hooks
    entered inside (offload, checkpoint) see what their segments save; those bytes are not
    held on the device."""

    def __init__(self, *state: nn.Module) -> None:
        params = {t.untyped_storage().data_ptr() for m in state
                  for t in (*m.parameters(), *m.buffers())}
        self.bytes = 0
        self._held: list[torch.Tensor] = []

        def pack(t: torch.Tensor) -> torch.Tensor:
            ptr = t.untyped_storage().data_ptr()
            if ptr not in params and all(h.untyped_storage().data_ptr() != ptr
                                         for h in self._held):
                self._held.append(t)
                self.bytes += t.untyped_storage().nbytes()
            return t

        super().__init__(pack, lambda t: t)


def _loss(out: Any) -> torch.Tensor:
    first = next(t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor))
    return first.float().square().mean()


def _step(module: nn.Module, params_of: nn.Module, args: tuple[Any, ...],
          kwargs: dict[str, Any], *state: nn.Module,
          ) -> tuple[torch.Tensor, dict[str, torch.Tensor], int, dict[str, torch.Tensor]]:
    """Loss, gradients, saved bytes and buffers after one training step from seed 7;
    parameters, buffers and constants of ``params_of`` and ``state`` are module state, not
    saved activations."""
    params_of.zero_grad(set_to_none=True)
    torch.manual_seed(7)
    counter = _SavedCounter(params_of, *state)
    with counter:
        out = module(*args, **kwargs)
    loss = _loss(out)  # outside the counter: the loss saves tensors of its own
    loss.backward()
    grads = {n: p.grad.clone() for n, p in params_of.named_parameters() if p.grad is not None}
    buffers = {n: b.detach().clone() for n, b in params_of.named_buffers()}
    return loss.detach(), grads, counter.bytes, buffers


def _assert_same_step(expected: tuple[Any, ...], actual: tuple[Any, ...]) -> None:
    torch.testing.assert_close(actual[0], expected[0])
    assert actual[1].keys() == expected[1].keys()
    for name, grad in expected[1].items():
        torch.testing.assert_close(actual[1][name], grad, rtol=1e-4, atol=1e-6, msg=name)
    # BatchNorm statistics updated once, as in eager (a recomputed segment must not twice).
    assert actual[3].keys() == expected[3].keys()
    for name, buffer in expected[3].items():
        torch.testing.assert_close(actual[3][name], buffer, msg=name)


# --- the runtime ------------------------------------------------------------------------------


def test_offload_copies_each_storage_once_and_gives_the_same_gradients() -> None:
    a = torch.randn(8, 8, requires_grad=True)
    offloader = Offloader(torch.device("cpu"))
    with offloader.hooks(0):
        h = a * 2  # saves nothing (a scalar factor)
        y = (h[:4] * h[4:]).sum()  # saves two views of h's one storage
    y.backward()
    expected = torch.cat([(a[4:] * 2) * 2, (a[:4] * 2) * 2]).detach()
    torch.testing.assert_close(a.grad, expected)
    assert offloader.stats.copies_out == 1 and offloader.stats.bytes_out == 8 * 8 * 4
    assert offloader.stats.copies_in == 1


def test_unpacked_tensor_is_a_copy_from_the_pool() -> None:
    offloader = Offloader(torch.device("cpu"))
    x = torch.randn(4, 4)
    with offloader.hooks(0):
        packed = offloader._pack(x, 0, {})
    restored = offloader._unpack(packed)
    assert torch.equal(restored, x)
    assert restored.untyped_storage().data_ptr() != x.untyped_storage().data_ptr()


def test_host_buffers_are_pooled_across_steps() -> None:
    model, args, _ = _mlp()
    gm = export_graph(model.train(), args, {})
    segments, _ = profile_activations(gm, args).segments(4)
    offloader = Offloader(torch.device("cpu"))
    plan = MemoryPlan(tuple(segments), (OFFLOAD,) * len(segments), 1, 1e9)
    planned = apply_plan(gm, plan, lambda seg, i: Offload(seg, offloader, i))
    _loss(planned(*args)).backward()
    gc.collect()
    allocated = offloader.stats.host_allocations
    for _ in range(2):
        _loss(planned(*args)).backward()
        gc.collect()
    assert allocated > 0
    assert offloader.stats.host_allocations == allocated  # steps 2 and 3 allocated nothing
    assert offloader.stats.copies_in == offloader.stats.copies_out


def test_offload_needs_a_runtime() -> None:
    model, args, _ = _mlp()
    gm = export_graph(model.train(), args, {})
    segments, _ = profile_activations(gm, args).segments(2)
    plan = MemoryPlan(tuple(segments), (OFFLOAD, KEEP), 1, 1e9)
    with pytest.raises(ValueError, match="no offload runtime"):
        apply_plan(gm, plan)


# --- mixed plans, applied directly -------------------------------------------------------------


@pytest.mark.parametrize("name", MODELS)
def test_mixed_plan_gives_eager_gradients(name: str) -> None:
    model, args, kwargs = MODELS[name]()
    model.train()
    reference = copy.deepcopy(model)
    gm = export_graph(model, args, kwargs)
    flat = flat_example_inputs(gm, args, kwargs)
    segments, _ = profile_activations(gm, flat).segments(8)
    cycle = [RECOMPUTE, OFFLOAD, SELECTIVE, KEEP]
    modes = []
    for seg in segments:  # each mode in turn, where the segment allows it
        while not seg.permits(cycle[0]):
            cycle.append(cycle.pop(0))
        modes.append(cycle[0])
        cycle.append(cycle.pop(0))
    assert {RECOMPUTE, OFFLOAD, KEEP} <= set(modes) and (SELECTIVE in modes or name == "cnn")
    offloader = Offloader(torch.device("cpu"))
    planned = apply_plan(gm, MemoryPlan(tuple(segments), modes, 1, 1e9),
                         lambda seg, i: Offload(seg, offloader, i))
    expected = _step(reference, reference, args, kwargs)
    actual = _step(planned, model, args, kwargs, planned)
    _assert_same_step(expected, actual)
    assert offloader.stats.copies_out > 0
    assert actual[2] < expected[2]


# --- recompute against every way eager trains -------------------------------------------------
# Forward runs outside any saved-tensor hook here: hooks around forward turn autograd's
# version-counter checks off, which hid a crash of recomputed BatchNorm segments.


class _Counter(nn.Module):
    """linear ─ × calls (a buffer the forward increments in place) ─ gelu ─ linear"""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(32, 64), nn.Linear(64, 4)
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.add_(1)
        return self.fc2(torch.nn.functional.gelu(self.fc1(x) * self.calls))


def _planned(model: nn.Module, args: tuple[Any, ...], mode: str) -> nn.Module:
    """The model's graph with every segment that permits it in ``mode``, the rest kept."""
    gm = export_graph(model, args, {})
    segments, _ = profile_activations(gm, flat_example_inputs(gm, args, {})).segments(4)
    modes = tuple(mode if seg.permits(mode) else KEEP for seg in segments)
    assert mode in modes
    return apply_plan(gm, MemoryPlan(tuple(segments), modes, 1, 1e9))


def _train(module: nn.Module, params_of: nn.Module, args: tuple[Any, ...], pattern: str,
           steps: int = 2) -> list[tuple[torch.Tensor, dict[str, torch.Tensor]]]:
    """Loss and gradients of each step from seed 7, by a backward pattern eager supports."""
    results = []
    torch.manual_seed(7)
    for _ in range(steps):
        params_of.zero_grad(set_to_none=True)
        x = args[0].detach().clone().requires_grad_(pattern == "gradient_penalty")
        loss = _loss(module(x, *args[1:]))
        if pattern == "gradient_penalty":  # a double backward, as WGAN-GP trains
            (grad,) = torch.autograd.grad(loss, x, create_graph=True)
            (loss + grad.square().sum()).backward()
        elif pattern == "retain_graph":
            loss.backward(retain_graph=True)
            loss.backward()
        else:
            loss.backward()
        grads = {n: p.grad.clone() for n, p in params_of.named_parameters()
                 if p.grad is not None}
        results.append((loss.detach(), grads))
    return results


def _assert_same_training(expected: list[Any], actual: list[Any]) -> None:
    for (loss, grads), (actual_loss, actual_grads) in zip(expected, actual, strict=True):
        torch.testing.assert_close(actual_loss, loss)
        assert actual_grads.keys() == grads.keys()
        for name, grad in grads.items():
            torch.testing.assert_close(actual_grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("name", ["cnn", "counter"])
def test_recomputed_state_writing_segments_train_like_eager(name: str) -> None:
    model, args = (_cnn()[:2] if name == "cnn" else (_Counter(), (torch.randn(8, 32),)))
    model.train()
    reference = copy.deepcopy(model)
    planned = _planned(model, args, RECOMPUTE)
    expected = _train(reference, reference, args, "plain")
    actual = _train(planned, model, args, "plain")
    _assert_same_training(expected, actual)
    # Statistics and counters updated once per forward, as in eager: not again in backward.
    for (key, buffer), (_, eager) in zip(model.state_dict().items(),
                                         reference.state_dict().items(), strict=True):
        torch.testing.assert_close(buffer, eager, msg=key)


@pytest.mark.parametrize("pattern", ["gradient_penalty", "retain_graph"])
@pytest.mark.parametrize("mode", [SELECTIVE, RECOMPUTE])
def test_recompute_supports_double_backward_and_retain_graph(mode: str, pattern: str) -> None:
    model, args, _ = _mlp()
    model.train()
    reference = copy.deepcopy(model)
    planned = _planned(model, args, mode)
    _assert_same_training(_train(reference, reference, args, pattern),
                          _train(planned, model, args, pattern))


def test_recomputed_batchnorm_supports_retain_graph() -> None:
    model, args, _ = _cnn()
    model.train()
    reference = copy.deepcopy(model)
    planned = _planned(model, args, RECOMPUTE)
    _assert_same_training(_train(reference, reference, args, "retain_graph"),
                          _train(planned, model, args, "retain_graph"))
    torch.testing.assert_close(model.state_dict(), reference.state_dict())


def test_optimized_batchnorm_model_trains_with_default_modes() -> None:
    model, args, _ = _cnn()
    model.train()
    reference = copy.deepcopy(model)
    unconstrained = profile_activations(export_graph(copy.deepcopy(model), args, {}),
                                        args).saved_bytes
    fast = autoopt.optimize(model, args, training=True, memory_budget=int(unconstrained * 0.7))
    plan = fast.report.captures[0].memory_plan
    assert plan is not None and any(
        mode == RECOMPUTE and seg.writes_state for seg, mode in zip(plan.segments, plan.modes,
                                                                    strict=True))
    _assert_same_training(_train(reference, reference, args, "plain"),
                          _train(fast, fast.module, args, "plain"))
    torch.testing.assert_close(fast.module.state_dict(), reference.state_dict())


# --- optimize(..., memory_budget=...) ----------------------------------------------------------


@pytest.mark.parametrize("modes", [(KEEP, OFFLOAD), (KEEP, RECOMPUTE), (KEEP, SELECTIVE), MODES],
                         ids=["offload", "recompute", "selective", "all"])
@pytest.mark.parametrize("name", MODELS)
def test_budget_met_with_eager_gradients(name: str, modes: tuple[str, ...]) -> None:
    if name == "cnn" and modes == (KEEP, SELECTIVE):
        pytest.skip("BatchNorm segments write running statistics, which selective recompute "
                    "cannot restore; convolution results are most of the rest")
    model, args, kwargs = MODELS[name]()
    model.train()
    reference = copy.deepcopy(model)
    expected = _step(reference, reference, args, kwargs)
    # 60% of eager's saved bytes: the small CNN's BatchNorm/ReLU chain cannot get below ~55%
    # by recompute alone (each short segment keeps an input as large as what it saves).
    budget = int(expected[2] * 0.6)
    fast = autoopt.optimize(model, args, kwargs, training=True, memory_budget=budget,
                            memory_modes=modes)
    plan = fast.report.captures[0].memory_plan
    assert plan is not None and plan.peak_bytes <= budget
    assert sum(plan.count(m) for m in modes if m != KEEP) > 0
    graphs = [spec.graph for spec in fast.specializations]  # their folded constants
    actual = _step(fast, fast.module, args, kwargs, *graphs)
    _assert_same_step(expected, actual)
    assert actual[2] <= budget
    assert "memory plan" in str(fast.report)


@pytest.mark.slow
def test_resnet18_recompute_gives_eager_gradients() -> None:
    model, _, _ = resnet18()
    model.train()
    args = (torch.randn(2, 3, 32, 32),)
    reference = copy.deepcopy(model)
    expected = _step(reference, reference, args, {})
    budget = expected[2] // 2
    fast = autoopt.optimize(model, args, training=True, memory_budget=budget)
    graphs = [spec.graph for spec in fast.specializations]
    actual = _step(fast, fast.module, args, {}, *graphs)
    _assert_same_step(expected, actual)
    assert actual[2] <= budget


def test_unmeetable_budget_names_the_smallest() -> None:
    model, args, kwargs = _mlp()
    with pytest.raises(autoopt.ConfigError, match=r"memory_budget=1024 cannot be met: .*"
                       r"the smallest budget a plan meets is .*Pass memory_budget=\d+ or more"):
        autoopt.optimize(model.train(), args, training=True, memory_budget=1024)


@pytest.mark.gpu
def test_cuda_offload_gives_eager_gradients_and_copies_on_a_side_stream() -> None:
    model, args, kwargs = _transformer()
    model.cuda().train()
    args = tuple(a.cuda() for a in args)
    reference = copy.deepcopy(model)
    expected = _step(reference, reference, args, kwargs)
    budget = expected[2] // 2
    fast = autoopt.optimize(model, args, kwargs, training=True, memory_budget=budget,
                            memory_modes=(KEEP, OFFLOAD))
    graph = fast.specializations[0].graph
    offloader = graph.meta["offloader"]
    actual = _step(fast, fast.module, args, kwargs, graph)
    torch.cuda.synchronize()
    gc.collect()
    allocations = offloader.stats.host_allocations
    actual = _step(fast, fast.module, args, kwargs, graph)  # reuses the pinned buffers
    _assert_same_step(expected, actual)
    assert actual[2] <= budget
    assert offloader.stats.copies_out > 0 and offloader.stats.host_allocations == allocations


class _ReluInPlaceThenConv(nn.Module):
    """A ResNet block's start: ReLU(inplace=True) on the block's input, then a convolution."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(4, 4, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(torch.relu_(x)) * x


def test_a_recomputed_segment_that_writes_its_activation_input_gives_eagers_gradients() -> None:
    """The rerun in backward starts from a copy of the input as the forward found it; the
    copy must require grad like the activation, or the rerun records less than the forward
    saved and checkpoint refuses it (resnet18's recompute plans failed so)."""
    from autoopt.runtime.recompute import Recompute

    block = _ReluInPlaceThenConv()
    gm = export_graph(block, (torch.randn(2, 4, 8, 8),), {})
    segment = Recompute(gm)
    assert segment._written == [0]  # the activation input, written in place
    source = torch.randn(2, 4, 8, 8, requires_grad=True)

    def step(run: nn.Module) -> tuple[torch.Tensor, ...]:
        x = source * 1.5  # an activation: a non-leaf that requires grad
        out = run(x)
        return (out, *torch.autograd.grad(out.sum(), [source, *run.parameters()]))

    expected = step(block)
    actual = step(segment)
    for got, wanted in zip(actual, expected, strict=True):
        torch.testing.assert_close(got, wanted)
