"""Models that break naive tracing: each must give eager's answer on a second, different call.

Where a capture would bake in something that can change (a flag, a length, Python state), the
optimized module must re-capture or fall back, never replay a stale graph.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from typing import Any

import pytest
import torch
from checks import assert_bit_identical, snapshot
from torch import nn

import autoopt
from autoopt.capture.graph import symbolic_trace_graph
from autoopt.check.compare import compare

Call = tuple[tuple[Any, ...], dict[str, Any]]


def run_side_by_side(model: nn.Module, calls: list[Call],
                     **options: Any) -> autoopt.OptimizedModule:
    """Optimize on the first call's inputs, then feed every call to the optimized module and
    to an eager copy in step, comparing outputs (state evolves in both the same way). Calls
    run the way the model is meant to: with gradients in train mode, without in eval mode."""
    before = snapshot(model)
    reference = copy.deepcopy(model)
    fast = autoopt.optimize(model, calls[0][0], calls[0][1], **options)
    for i, (args, kwargs) in enumerate(calls):
        with torch.set_grad_enabled(model.training):
            expected = reference(*args, **kwargs)
            actual = fast(*args, **kwargs)
        result = compare(expected, actual)
        assert result.ok, f"call {i}: {result.detail}\n{fast.report}"
    assert_bit_identical(model, before)
    return fast


def x(*shape: int) -> torch.Tensor:
    return torch.randn(*shape)


class ItemScale(nn.Module):
    def forward(self, v: torch.Tensor) -> torch.Tensor:
        return v * v.abs().max().item()


class ItemBranch(nn.Module):
    def forward(self, v: torch.Tensor) -> torch.Tensor:
        if v.sum().item() > 0:
            return v + 1
        return v - 1


class DataDependentIf(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, v: torch.Tensor) -> torch.Tensor:
        h = self.linear(v)
        if h.sum() > 0:
            return torch.relu(h)
        return torch.tanh(h) * 2


class LoopOverList(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, xs: list[torch.Tensor]) -> torch.Tensor:
        total = torch.zeros(4)
        for i in range(len(xs)):
            total = total + self.linear(xs[i]).sum(0) * (i + 1)
        return total


@dataclasses.dataclass
class Pair:
    first: torch.Tensor
    second: torch.Tensor


class DataclassOut(nn.Module):
    def forward(self, v: torch.Tensor) -> Pair:
        return Pair(v.sin(), v.cos())


class Flagged(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, v: torch.Tensor, double: bool = False) -> torch.Tensor:
        out = self.linear(v)
        return out * 2 if double else out


class Counter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def forward(self, v: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return v + self.calls


class NoGradBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, v: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            frozen = self.a(v)
        return self.b(v) + frozen


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(ids))


class CalledTwice(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = nn.Sequential(nn.Linear(4, 4), nn.GELU())

    def forward(self, v: torch.Tensor) -> torch.Tensor:
        return self.block(self.block(v))


class StraightThrough(torch.autograd.Function):
    """round() forward, identity backward: its gradient is not the forward ops' gradient."""

    @staticmethod
    def forward(ctx: Any, v: torch.Tensor) -> torch.Tensor:
        return v.round()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad


class Quantized(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, v: torch.Tensor) -> torch.Tensor:
        return StraightThrough.apply(self.linear(v)) * 3


def test_item_used_as_a_number_stays_symbolic() -> None:
    fast = run_side_by_side(ItemScale(), [((x(5),), {}), ((x(5) * 10,), {})])
    assert fast.report.capture_method == "export"


def test_item_in_control_flow_takes_the_other_branch() -> None:
    positive, negative = torch.ones(3), -torch.ones(3)
    fast = run_side_by_side(ItemBranch(), [((positive,), {}), ((negative,), {})])
    assert fast.report.capture_method == "dynamo"


def test_data_dependent_control_flow_is_partially_captured() -> None:
    model = DataDependentIf()
    with torch.no_grad():
        model.linear.bias.fill_(0)
    fast = run_side_by_side(model, [((torch.ones(2, 4),), {}), ((-torch.ones(2, 4),), {}),
                                    ((x(2, 4),), {})])
    capture = fast.report.captures[0]
    assert capture.method == "dynamo" and capture.subgraphs >= 2
    assert [m for m, _ in capture.attempts] == ["export", "symbolic_trace"]


def test_list_input_whose_length_changes_is_recaptured() -> None:
    calls = [(([x(2, 4), x(2, 4)],), {}), (([x(2, 4), x(2, 4), x(2, 4)],), {}),
             (([x(2, 4), x(2, 4)],), {})]
    fast = run_side_by_side(LoopOverList(), calls)
    assert [c.method for c in fast.report.captures] == ["export", "export"]


def test_dataclass_output() -> None:
    fast = run_side_by_side(DataclassOut(), [((x(3),), {}), ((x(3),), {})])
    assert isinstance(fast(x(3)), Pair)


def test_non_tensor_flag_that_changes_is_recaptured() -> None:
    calls = [((x(2, 4),), {"double": False}), ((x(2, 4),), {"double": True}),
             ((x(2, 4),), {"double": False})]
    fast = run_side_by_side(Flagged(), calls)
    assert len(fast.report.captures) == 2


def test_sequence_length_change_is_recaptured_or_dynamic() -> None:
    model = nn.TransformerEncoderLayer(d_model=8, nhead=2, dim_feedforward=16,
                                       batch_first=True).eval()
    calls = [((x(2, 5, 8),), {}), ((x(2, 9, 8),), {})]
    static = run_side_by_side(model, calls)
    assert len(static.report.captures) == 2
    dynamic = run_side_by_side(model, calls, dynamic=True)
    assert len(dynamic.report.captures) == 1


def test_dynamic_batch_dimension_serves_other_batch_sizes_from_one_graph() -> None:
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2)).eval()
    batch = torch.export.Dim("batch", min=1, max=1024)
    calls = [((x(4, 8),), {}), ((x(7, 8),), {}), ((x(1, 8),), {})]
    fast = run_side_by_side(model, calls, dynamic_shapes=({0: batch},))
    assert len(fast.report.captures) == 1
    assert "?" in fast.report.captures[0].inputs or fast.specializations[0].signature.leaves[
        0].shape[0] is None


def test_python_state_mutated_in_forward_is_replayed() -> None:
    fast = run_side_by_side(Counter(), [((x(2),), {}), ((x(2),), {}), ((x(2),), {})])
    capture = fast.report.captures[0]
    assert capture.method == "dynamo"
    assert any("Python state (calls)" in why for _, why in capture.attempts)
    assert fast.module.calls == 3  # verification runs left no trace


def test_forward_hooks_run_on_every_call() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    seen: list[tuple[int, ...]] = []
    model[0].register_forward_hook(lambda mod, inp, out: seen.append(tuple(out.shape)))
    model.register_forward_hook(lambda mod, inp, out: out * 10)
    fast = autoopt.optimize(model, (x(2, 4),))
    assert any("hooks" in why for _, why in fast.report.captures[0].attempts)
    seen.clear()
    v = x(3, 4)
    torch.testing.assert_close(fast(v), model(v))
    assert seen == [(3, 4), (3, 4)]  # once for fast, once for eager


def test_hooks_registered_after_optimize_run_on_later_calls() -> None:
    """A hook registered on ``fast.module`` after capture: the whole graph (its BatchNorm
    folded by a pass) kept serving calls and ran none (an ablation hook ignored: a wrong
    answer; a recording hook saw nothing). Its graphs go, and Dynamo, which runs hooks,
    captures the model again."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(),
                          nn.Linear(8 * 6 * 6, 4)).eval()
    twin = copy.deepcopy(model)
    v = x(2, 3, 8, 8)
    with torch.no_grad():
        fast = autoopt.optimize(model, (v,))
        assert fast.report.captures[0].method == "export"
        fast(v)
        seen: list[tuple[int, ...]] = []
        for m in (fast.module, twin):
            m[0].register_forward_hook(lambda mod, inp, out: out * 0.5)
            m[4].register_forward_hook(lambda mod, inp, out: seen.append(tuple(out.shape)))
        w = x(2, 3, 8, 8)
        torch.testing.assert_close(fast(w), twin(w))  # captured again (verification runs)
        seen.clear()
        torch.testing.assert_close(fast(v), twin(v))
        assert seen == [(2, 4), (2, 4)]  # once for fast, once for the twin
        # One more on the Dynamo capture: Dynamo guards on hooks there (by default it
        # assumes none is added after it compiled, and this one never ran).
        for m in (fast.module, twin):
            m[2].register_forward_hook(lambda mod, inp, out: out + 1.0)
        torch.testing.assert_close(fast(v), twin(v))
    assert fast.report.captures[-1].method == "dynamo"
    assert any("hooks were registered after capture" in n for n in fast.report.warnings)
    for a, b in zip(model.state_dict().values(), twin.state_dict().values(), strict=True):
        torch.testing.assert_close(a, b)  # the user's model is not the one hooked


def test_batchnorm_in_train_mode_updates_running_stats_like_eager() -> None:
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU()).train()
    reference = copy.deepcopy(model)
    calls = [((x(2, 3, 8, 8),), {}), ((x(2, 3, 8, 8) * 3 + 1,), {})]
    fast = run_side_by_side(model, calls)
    assert fast.report.capture_method == "export"
    for args, _ in calls:
        reference(*args)
    torch.testing.assert_close(fast.module[1].running_mean, reference[1].running_mean)
    torch.testing.assert_close(fast.module[1].running_var, reference[1].running_var)
    assert int(fast.module[1].num_batches_tracked) == 2


def test_train_eval_switch_is_recaptured() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5), nn.BatchNorm1d(4)).train()
    fast = autoopt.optimize(model, (x(8, 4),))
    fast.eval()
    reference = copy.deepcopy(fast.module).eval()
    v = x(8, 4)
    torch.testing.assert_close(fast(v), reference(v))
    assert len(fast.report.captures) == 2


@pytest.mark.parametrize("factory, make_input", [
    (NoGradBlock, lambda: x(3, 4)),
    (Tied, lambda: torch.randint(0, 10, (2, 5))),
    (CalledTwice, lambda: x(3, 4)),
])
def test_graph_features_match_eager_including_gradients(
        factory: Callable[[], nn.Module], make_input: Callable[[], torch.Tensor]) -> None:
    model = factory()
    fast = run_side_by_side(model, [((make_input(),), {}), ((make_input(),), {})])
    assert fast.report.capture_method == "export"
    reference = copy.deepcopy(model)
    v = make_input()
    fast(v).square().sum().backward()
    reference(v).square().sum().backward()
    grads = dict(fast.module.named_parameters())
    for name, p in reference.named_parameters():
        torch.testing.assert_close(grads[name].grad, p.grad, msg=name)
    if factory is Tied:
        assert fast.module.head.weight is fast.module.embed.weight


def test_custom_autograd_function_keeps_its_backward() -> None:
    model = Quantized()
    fast = run_side_by_side(model, [((x(2, 4),), {}), ((x(2, 4),), {})])
    assert any("autograd.Function" in why for _, why in fast.report.captures[0].attempts)
    v1, v2 = x(2, 4).requires_grad_(), None
    v2 = v1.detach().clone().requires_grad_()
    fast(v1).sum().backward()
    copy.deepcopy(model)(v2).sum().backward()
    torch.testing.assert_close(v1.grad, v2.grad)
    assert float(v1.grad.abs().sum()) > 0  # the straight-through gradient, not round()'s zero


def test_kwargs_inputs() -> None:
    calls = [((x(2, 4),), {"double": True}), ((x(2, 4),), {"double": True})]
    fast = run_side_by_side(Flagged(), calls)
    assert len(fast.report.captures) == 1


def test_a_capture_that_bakes_a_changing_value_is_rejected() -> None:
    import random

    class PythonRandom(nn.Module):
        def forward(self, v: torch.Tensor) -> torch.Tensor:
            return v * random.random()  # torch's seed does not reach Python's random

    fast = autoopt.optimize(PythonRandom(), (x(4),), capture=("export",))
    capture = fast.report.captures[0]
    assert capture.method == "eager"
    assert "captured graph differs from eager" in capture.attempts[0][1]
    assert capture.passes == [] and capture.verification is None


class _CachesThenIterates(nn.Module):
    """Caches a tensor on its first call (like torchvision's anchor generator), then iterates
    over a tensor, which symbolic_trace cannot follow but Dynamo can."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.anchors: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.anchors is None:
            self.anchors = torch.zeros_like(x[0])  # a proxy while symbolic_trace runs
        rows = [row * 2 for row in self.fc(x)]  # iterating a proxy: symbolic_trace fails
        if x.sum() > 1e9:  # data-dependent: export fails
            return x
        return torch.stack(rows) + self.anchors


def test_a_failed_trace_leaves_no_trace_for_the_next_method() -> None:
    """A failed symbolic_trace left its constants (``_tensor_constant0``) and the proxies the
    forward cached on the module, and Dynamo then failed on them (torchvision detection ran
    eagerly for that reason)."""
    model = _CachesThenIterates().eval()
    with pytest.raises(Exception, match="Proxy"):
        symbolic_trace_graph(model, (torch.randn(3, 4),), {})
    assert model.anchors is None
    assert not [k for k in vars(model) if k.startswith("_tensor_constant")]
    fast = run_side_by_side(model, [((torch.randn(3, 4),), {}), ((torch.randn(3, 4),), {})])
    capture = fast.report.captures[0]
    assert capture.method == "dynamo", capture.attempts
    assert [m for m, _ in capture.attempts] == ["export", "symbolic_trace"]
    assert model.anchors is None
