"""Never a wrong answer: what a captured graph assumes is guarded, checked or put back.

Each test is a reproduction from issue 22 that returned a wrong result without an error: a
gradient lost through a lowered kernel, a dynamic graph replayed outside the sizes export
proved it for, weights replaced or edited where no version counter sees it, a Python attribute
the graph baked in, a forward that writes its input, ``functional_call``, concurrent calls.
"""

from __future__ import annotations

import copy
import pickle
import threading
import types

import pytest
import torch
from torch import nn
from torch.fx import GraphModule

import autoopt
from autoopt.passes import PassContext, PassResult
from autoopt.passes.packed_linear import available as mkl_available

aten = torch.ops.aten
# Pin the measured choice: the lowering applies wherever it can, whatever this CPU measures.
ALWAYS_LOWER = {"packed_linear": {"measure": False}, "onednn_conv": {"measure": False}}


def frozen_mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 10)).eval().requires_grad_(
        False)


# --- gradients -------------------------------------------------------------------------------


@pytest.mark.skipif(not mkl_available(torch.device("cpu")), reason="no MKL packed linear here")
def test_input_gradient_through_a_frozen_model_is_not_lost() -> None:
    """Saliency maps and adversarial inputs: no parameter requires grad, the input does."""
    model = frozen_mlp()
    x = torch.randn(4, 32)
    fast = autoopt.optimize(model, (x,), pass_options=ALWAYS_LOWER)
    mine, theirs = x.clone().requires_grad_(), x.clone().requires_grad_()
    fast(mine).sum().backward()
    model(theirs).sum().backward()
    assert mine.grad is not None
    torch.testing.assert_close(mine.grad, theirs.grad)


@pytest.mark.skipif(not mkl_available(torch.device("cpu")), reason="no MKL packed linear here")
def test_unfreezing_after_a_frozen_capture_trains_the_parameters() -> None:
    model = frozen_mlp()
    x = torch.randn(4, 32)
    fast = autoopt.optimize(model, (x,), pass_options=ALWAYS_LOWER)
    fast(x).sum()  # with gradients on but nothing to differentiate: lowered kernels are fine
    fast.requires_grad_(True)
    fast(x).sum().backward()
    assert all(p.grad is not None for p in fast.parameters())
    reference = copy.deepcopy(model).requires_grad_(True)
    reference(x).sum().backward()
    for mine, theirs in zip(fast.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(mine.grad, theirs.grad)


def _detach_first_linear(gm: GraphModule, ctx: PassContext) -> PassResult:
    """A broken pass: the same forward, but no gradient flows through the first linear."""
    for node in gm.graph.nodes:
        if node.target is aten.linear.default:
            with gm.graph.inserting_after(node):
                cut = gm.graph.call_function(aten.detach.default, (node,))
            node.replace_all_uses_with(cut, delete_user_cb=lambda user, cut=cut: user is not cut)
            return PassResult(gm, True, {"detached": 1})
    return PassResult(gm, False)


def test_verification_compares_gradients_and_rolls_back_a_pass_that_loses_them() -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2)).train()
    x = torch.randn(3, 8)
    fast = autoopt.optimize(model, (x,), pipeline=(("detach", _detach_first_linear),))
    (record,) = fast.report.captures[0].passes
    assert record.status == "rolled_back" and "grad of parameter 0.weight" in record.reason
    fast(x).sum().backward()
    assert fast.module[0].weight.grad is not None


# --- shapes ----------------------------------------------------------------------------------


class BranchOnBatch(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l(x) * 2 if x.shape[0] > 4 else self.l(x)


@torch.no_grad()
def test_a_dynamic_graph_is_not_replayed_outside_the_range_export_proved() -> None:
    model = BranchOnBatch().eval()
    fast = autoopt.optimize(model, (torch.randn(3, 8),), dynamic=True)
    for batch in (2, 4, 5, 8, 3):
        x = torch.randn(batch, 8)
        torch.testing.assert_close(fast(x), model(x))
    # One graph for batches 2-4, one for the other branch (or the other sizes).
    assert 2 <= len(fast.report.captures) <= 3


class Strided(nn.Module):
    """A size relation: the graph is valid only where ``2 * x.size(0) <= y.size(0)``."""

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return x + y[: x.shape[0] * 2 : 2]


@torch.no_grad()
def test_a_dynamic_graph_checks_relations_between_sizes() -> None:
    model = Strided().eval()
    fast = autoopt.optimize(model, (torch.randn(3, 4), torch.randn(6, 4)), dynamic=True)
    x, y = torch.randn(5, 4), torch.randn(12, 4)
    torch.testing.assert_close(fast(x, y), model(x, y))
    assert len(fast.report.captures) == 1  # within what export proved: one graph
    with pytest.raises(Exception, match="size"):  # eager raises too: 3 rows from 4
        fast(torch.randn(3, 4), torch.randn(4, 4))


@torch.no_grad()
def test_keyword_arguments_in_another_order_reuse_the_graph() -> None:
    class AddScaled(nn.Module):
        def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            return a + 2 * b

    fast = autoopt.optimize(AddScaled().eval(), (), {"a": torch.randn(3), "b": torch.randn(3)})
    a, b = torch.randn(3), torch.randn(3)
    torch.testing.assert_close(fast(b=b, a=a), a + 2 * b)
    assert len(fast.report.captures) == 1


# --- the module's state ----------------------------------------------------------------------


def test_load_state_dict_with_assign_reaches_a_training_graph() -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4)).train()
    x = torch.randn(4, 8)
    fast = autoopt.optimize(model, (x,))
    fast(x).sum().backward()
    new = {k: torch.randn_like(v) for k, v in fast.module.state_dict().items()}
    fast.module.load_state_dict(new, assign=True)
    reference = copy.deepcopy(model)
    reference.load_state_dict(new)
    out = fast(x)
    torch.testing.assert_close(out, reference(x))
    out.sum().backward()
    assert all(p.grad is not None for p in fast.parameters())


@torch.no_grad()
@pytest.mark.parametrize("edit", ["weight", "statistic", "swap"])
def test_edits_through_data_reach_folded_constants(edit: str) -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Linear(8, 4)).eval()
    x = torch.randn(4, 8)
    fast = autoopt.optimize(model, (x,))
    fast(x)
    if edit == "weight":  # old EMA and init code: no version counter sees it
        fast.module[0].weight.data.mul_(0.5)
    elif edit == "statistic":
        fast.module[1].running_var.data.mul_(3)
    else:
        fast.module[0].weight.data = torch.randn(8, 8)
    torch.testing.assert_close(fast(x), copy.deepcopy(fast.module)(x))


class Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l = nn.Linear(8, 8)
        self.scale = 2.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l(x) * self.scale


@torch.no_grad()
def test_a_python_attribute_changed_after_capture_is_not_replayed() -> None:
    fast = autoopt.optimize(Scaled().eval(), (x := torch.randn(3, 8),))
    fast(x)
    fast.module.scale = 3.0
    torch.testing.assert_close(fast(x), fast.module.l(x) * 3.0)


class _Settings:
    """A settings object the model reads (a transformers config)."""

    def __init__(self) -> None:
        self.hidden = 16


class ReadsOptional(nn.Module):
    """Reads settings that may be missing (``getattr(..., default)``) and calls a submodule
    whose ``forward`` a wrapper may replace on the instance (accelerate's hooks, PEFT)."""

    def __init__(self) -> None:
        super().__init__()
        self.config = _Settings()
        self.l1, self.act, self.l2 = nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.act(self.l1(x)) / getattr(self, "temperature", 1.0)
        return self.l2(h * getattr(self.config, "scale", 1.0))


@pytest.mark.parametrize("training", [False, True], ids=["eval", "train"])
def test_attributes_added_and_forwards_patched_after_capture_are_not_replayed(
        training: bool) -> None:
    """The watch compared the values of the names there at capture; a name added later (read
    with a default) or a ``forward`` set on the instance left the old graph running (off by
    0.5-1.5 on this model, in eval and in training)."""
    model = ReadsOptional().train(training)
    reference = copy.deepcopy(model)
    x = torch.randn(4, 8)
    fast = autoopt.optimize(model, (x,), training=training)

    def same() -> None:
        with torch.set_grad_enabled(training):
            torch.testing.assert_close(fast(x), reference(x))

    same()
    for m in (fast.module, reference):
        m.temperature = 4.0
    same()
    for m in (fast.module, reference):
        m.config.scale = 10.0
    same()
    for m in (fast.module, reference):
        m.act.forward = types.MethodType(lambda self, t: torch.relu(t) * 3.0, m.act)
    same()
    for m in (fast.module, reference):
        m.forward = types.MethodType(lambda self, t: -self.l2(self.l1(t)), m)
    same()
    for m in (fast.module, reference):  # and back: the class's own forward again
        del m.forward, m.act.forward, m.temperature
    same()


class WritesInput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x.mul_(2)
        return torch.tanh(self.fc(x))


@torch.no_grad()
def test_a_forward_that_writes_its_input_writes_it_once_and_optimize_leaves_yours() -> None:
    model = WritesInput().eval()
    example = torch.randn(3, 8)
    kept = example.clone()
    fast = autoopt.optimize(model, (example,))
    assert torch.equal(example, kept)  # optimize ran the model many times, on copies
    mine, theirs = kept.clone(), kept.clone()
    torch.testing.assert_close(fast(mine), model(theirs))
    torch.testing.assert_close(mine, theirs)  # the caller's input is written, as eager does


def test_functional_call_uses_the_parameters_it_is_given() -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 3)).eval()
    x = torch.randn(3, 8)
    # Lowered kernels in the graph, whatever this CPU measures: the graph holds constants.
    fast = autoopt.optimize(model, (x,), pass_options=ALWAYS_LOWER)
    params = {k: torch.randn_like(v) for k, v in fast.named_parameters()}
    with torch.no_grad():
        out = torch.func.functional_call(fast, params, (x,))
        plain = {k.removeprefix("module."): v for k, v in params.items()}
        torch.testing.assert_close(out, torch.func.functional_call(model, plain, (x,)))
        torch.testing.assert_close(fast(x), model(x))  # the module's own weights afterwards
    grads = torch.func.grad(lambda p: torch.func.functional_call(fast, p, (x,)).sum())(params)
    expected = torch.func.grad(lambda p: torch.func.functional_call(model, p, (x,)).sum())(plain)
    for name, g in grads.items():
        torch.testing.assert_close(g, expected[name.removeprefix("module.")])
    assert all(p.grad is None for p in fast.parameters())


@torch.no_grad()
def test_a_train_mode_model_under_no_grad_is_captured_once() -> None:
    """BatchNorm recalibration (swa_utils.update_bn): the graph's own statistic updates leave
    it current."""
    model = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.ReLU()).train()
    fast = autoopt.optimize(model, (torch.randn(4, 8),), training=False)
    reference = copy.deepcopy(model)
    for _ in range(5):
        x = torch.randn(4, 8)
        torch.testing.assert_close(fast(x), reference(x))
    torch.testing.assert_close(fast.module[1].running_mean, reference[1].running_mean)
    assert len(fast.report.captures) == 1


def test_optimize_leaves_the_global_rng_where_it_was() -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5)).eval()
    torch.manual_seed(1)
    x = torch.randn(4, 8)
    autoopt.optimize(model, (x,))
    after = torch.rand(3)
    torch.manual_seed(1)
    torch.randn(4, 8)
    torch.testing.assert_close(after, torch.rand(3), rtol=0, atol=0)


def test_pickle_round_trip_captures_again() -> None:
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU()).eval()
    x = torch.randn(1, 3, 8, 8)
    fast = autoopt.optimize(model, (x,), pass_options=ALWAYS_LOWER)
    loaded = pickle.loads(pickle.dumps(fast))
    with torch.no_grad():
        torch.testing.assert_close(loaded(x), model(x))
    assert len(loaded.report.captures) == len(fast.report.captures) + 1


# --- threads ---------------------------------------------------------------------------------


def test_concurrent_calls_with_new_shapes_give_eager_results() -> None:
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4)).eval()
    fast = autoopt.optimize(model, (torch.randn(2, 16),))
    errors: list[str] = []

    def work(batch: int) -> None:
        try:
            for k in range(3):
                x = torch.randn(batch + k, 16)
                with torch.no_grad():
                    torch.testing.assert_close(fast(x), model(x))
        except Exception as exc:  # noqa: BLE001 - reported below with the thread's input
            errors.append(f"batch {batch}: {type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=work, args=(b,)) for b in (2, 3, 4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert torch.ones(2).sum().item() == 2.0  # no fake mode left behind in this thread



class _PausesInExport(nn.Module):
    """Holds its capture for a new batch size mid-trace, while export has its own tensors in
    the module's slots. (Events on the class: autoopt captures a deep copy.)"""

    tracing = threading.Event()
    resume = threading.Event()

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_exporting() and x.shape[0] == 3:
            self.tracing.set()
            self.resume.wait(30)
        return self.lin(x).relu()


def test_a_call_during_another_threads_capture_runs_its_graph_after_it() -> None:
    _PausesInExport.tracing.clear()
    _PausesInExport.resume.clear()
    model = _PausesInExport().eval()
    fast = autoopt.optimize(model, (torch.randn(2, 8),))
    x = torch.randn(2, 8)
    capture = threading.Thread(target=fast, args=(torch.randn(3, 8),))
    capture.start()
    assert model.tracing.wait(30)
    result: dict[str, torch.Tensor] = {}
    call = threading.Thread(target=lambda: result.setdefault("y", fast(x)))
    call.start()
    call.join(0.3)
    assert call.is_alive()  # held back until the capture is done, not run on its tensors
    model.resume.set()
    capture.join()
    call.join()
    with torch.no_grad():
        torch.testing.assert_close(result["y"], model(x))
    # It was not taken for the caller's swap (functional_call): no eager run, no warning.
    assert not any("replaced" in w for w in fast.report.warnings), fast.report.warnings
    assert fast.specialization_for((x,)).graph is not None

def test_frozen_weights_folded_into_a_gradient_graph_are_watched() -> None:
    """Fine-tuning a head on a frozen backbone: with gradients on, passes still fold the
    frozen BatchNorm into its frozen convolution (no gradient reaches them), so a load that
    writes those weights must drop the graph (found by the stateful fuzzer's long profile)."""
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Flatten(),
                          nn.Linear(4 * 6 * 6, 3)).eval()
    model[0].requires_grad_(False)
    model[1].requires_grad_(False)
    x = torch.randn(2, 3, 8, 8)
    fast = autoopt.optimize(model, (x,), training=False)
    fast(x).sum().backward()  # captured with gradients: the head trains
    assert any(r.name == "fold_batchnorm" and r.status == "applied"
               for c in fast.report.captures for r in c.passes)
    new = {k: torch.randn_like(v) if v.is_floating_point() else v
           for k, v in fast.module.state_dict().items()}
    new["1.running_var"] = new["1.running_var"].abs()
    fast.module.load_state_dict(new)
    reference = copy.deepcopy(fast.module)
    torch.testing.assert_close(fast(x), reference(x))
    # Optimizer steps on the head do not drop the graph: nothing was copied from it.
    captures = len(fast.report.captures)
    optimizer = torch.optim.SGD([p for p in fast.parameters() if p.requires_grad], lr=0.1)
    for _ in range(3):
        optimizer.zero_grad()
        fast(x).sum().backward()
        optimizer.step()
    assert len(fast.report.captures) == captures
    torch.testing.assert_close(fast(x), fast.module(x))


@torch.no_grad()
def test_functional_call_in_train_mode_leaves_the_users_statistics() -> None:
    """The eager run functional_call gets updates BatchNorm statistics in train mode; while
    the module still shared the user's buffers, those were the user's (fuzzer's long
    profile)."""
    model = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8)).eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.randn(4, 8)
    fast = autoopt.optimize(model, (x,))
    fast.module[1].train()
    params = {k: torch.randn_like(v) for k, v in fast.named_parameters()}
    torch.func.functional_call(fast, params, (x,))
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k


@torch.no_grad()
def test_a_functional_call_before_any_graph_captures_nothing_from_its_tensors() -> None:
    """After ``.to()`` dropped every graph, the next call was a functional_call: it captured
    a graph with the swapped-in weights folded in, which later plain calls replayed (the
    stateful fuzzer's long profile)."""
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)).eval()
    x = torch.randn(1, 3, 6, 6)
    fast = autoopt.optimize(model, (x,))
    fast.to(torch.float64).to(torch.float32)  # drops every graph
    params = {k: torch.randn_like(v) for k, v in fast.named_parameters()}
    torch.func.functional_call(fast, params, (x,))
    torch.testing.assert_close(fast(x), model(x))


def test_statistics_a_train_mode_call_writes_reach_an_eval_graph() -> None:
    """A train-mode call under inference_mode updates BatchNorm statistics without bumping
    their version counters; the eval graph that folded them must still see the change."""
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)).eval()
    x = torch.randn(2, 3, 6, 6)
    fast = autoopt.optimize(model, (x,))
    reference = copy.deepcopy(model)
    for caller, m in ((fast, fast.module), (reference, reference)):
        m.train()
        with torch.inference_mode():
            caller(x + 1)  # through the optimized module: its train-mode graph writes them
        m.eval()
    with torch.no_grad():
        torch.testing.assert_close(fast(x), reference(x))


def test_a_forward_that_writes_its_buffers_never_writes_the_users_model() -> None:
    # An inference module shares the user's weight memory until something would write it;
    # a forward that counts its calls in a buffer writes it on every call.
    class Counting(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(4, 4)
            self.register_buffer("calls", torch.zeros(()))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.calls.add_(1)
            return self.linear(x) * self.calls

    model = Counting().eval()
    reference = copy.deepcopy(model)
    x = torch.randn(2, 4)
    fast = autoopt.optimize(model, (x,))
    for _ in range(3):
        with torch.no_grad():
            torch.testing.assert_close(fast(x), reference(x))
    assert model.calls.item() == 0 and fast.module.calls.item() == 3
    assert torch.equal(model.linear.weight, reference.linear.weight)


@torch.no_grad()
def test_a_graph_stale_before_another_capture_is_not_replayed() -> None:
    """The per-call check compares the tensors with the fingerprint taken after the last
    capture; a graph already stale then (weights written, then a new shape captured through
    ``specialization_for``, which runs no per-call check) must still be dropped."""
    model = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Linear(8, 4)).eval()
    x = torch.randn(4, 8)
    fast = autoopt.optimize(model, (x,), pass_options=ALWAYS_LOWER)
    fast(x)
    fast.module[0].weight.mul_(0.5)  # in place: the first graph's folded copy is old
    fast.specialization_for((torch.randn(2, 8),))
    torch.testing.assert_close(fast(x), copy.deepcopy(fast.module)(x))


class Configured(nn.Module):
    """A BatchNorm folded into the convolution's copy, a Python attribute and a config object
    the graph bakes in, submodules in a Sequential."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.bn = nn.BatchNorm2d(4)
        self.head = nn.Sequential(nn.ReLU(), nn.Conv2d(4, 2, 1))
        self.config = types.SimpleNamespace(scale=2.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.bn(self.conv(x))) * self.config.scale


def _fresh(like: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(torch.randn_like(like))


EDITS = {
    "parameter assigned": lambda m: setattr(m.conv, "weight", _fresh(m.conv.weight)),
    "slot swapped in": lambda m: m.conv._parameters.__setitem__("weight", _fresh(m.conv.weight)),
    "submodule replaced": lambda m: m.head.__setitem__(1, nn.Conv2d(4, 2, 1)),
    "attribute": lambda m: setattr(m.bn, "eps", float(torch.rand(()))),
    "attribute through __dict__": lambda m: m.bn.__dict__.__setitem__("eps",
                                                                      float(torch.rand(()))),
    "config attribute": lambda m: setattr(m.config, "scale", float(torch.rand(()))),
    "config replaced whole": lambda m: setattr(
        m, "config", types.SimpleNamespace(scale=float(torch.rand(())))),
    "train mode and back": lambda m: m.bn.train(not m.bn.training),
    "training through __dict__": lambda m: m.bn.__dict__.__setitem__("training",
                                                                     not m.bn.training),
    "in place": lambda m: m.bn.running_mean.add_(1),
    "through .data": lambda m: m.bn.running_var.data.mul_(2),
    "memory swapped": lambda m: setattr(m.conv.weight, "data", torch.randn_like(m.conv.weight)),
}


@torch.no_grad()
@pytest.mark.parametrize("edit", EDITS)
def test_edits_after_many_unchanged_calls_are_seen(edit: str) -> None:
    """The per-call check skips its walk of slots, attributes and modes while nothing it
    reads changed; after many calls on that fast path, each kind of edit, made twice, still
    reaches the result (a replaced submodule did not, before submodules were watched)."""
    fast = autoopt.optimize(Configured().eval(), (torch.randn(1, 3, 8, 8),))
    x = torch.randn(1, 3, 8, 8)
    for _ in range(2):
        for _ in range(30):
            fast(x)
        EDITS[edit](fast.module)
        for _ in range(3):  # the call that sees it, and those on the fast path again
            torch.testing.assert_close(fast(x), copy.deepcopy(fast.module)(x))


@torch.no_grad()
def test_an_attribute_changed_while_no_graph_exists_and_put_back_is_seen() -> None:
    """``.to()`` drops every graph; an attribute changed before the next call was traced by
    that call's capture but not recorded, so putting it back passed for unchanged and the
    graph traced with the other value was replayed."""
    model = Configured().eval()
    x = torch.randn(1, 3, 8, 8)
    fast = autoopt.optimize(model, (x,))
    fast.to(torch.float32)  # drops every graph
    fast.module.config.scale = 5.0
    torch.testing.assert_close(fast(x), copy.deepcopy(fast.module)(x))
    fast.module.config.scale = 2.0  # the value before the drop
    torch.testing.assert_close(fast(x), copy.deepcopy(fast.module)(x))


@torch.no_grad()
def test_specialization_for_checks_the_module_as_a_call_does() -> None:
    """A graph captured by ``specialization_for`` after an attribute changed traced the new
    value; putting the value back must still drop it (the snapshot was the old value's, so
    it passed for unchanged)."""
    fast = autoopt.optimize(Configured().eval(), (torch.randn(1, 3, 8, 8),))
    y = torch.randn(2, 3, 8, 8)
    fast.module.config.scale = 5.0
    fast.specialization_for((y,))
    fast.module.config.scale = 2.0  # the value at optimize
    torch.testing.assert_close(fast(y), copy.deepcopy(fast.module)(y))
