"""The module optimize returns: specializations, limits, device moves, saving."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from torch import nn

import autoopt
from autoopt.capture.program import save_program


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(6, 12), nn.GELU(), nn.Dropout(0.1), nn.Linear(12, 3)).eval()


def test_new_shapes_beyond_the_limit_run_eagerly_with_a_warning() -> None:
    model = mlp()
    fast = autoopt.optimize(model, (torch.randn(1, 6),), max_specializations=2, dynamic=False)
    fast(torch.randn(2, 6))
    with pytest.warns(UserWarning, match="max_specializations"):
        out = fast(v := torch.randn(3, 6))
    torch.testing.assert_close(out, model(v))
    assert [c.method for c in fast.report.captures] == ["export", "export"]
    assert any("dynamic=True" in w for w in fast.report.warnings)


def test_parameters_are_the_private_copy_and_state_dict_round_trips() -> None:
    model = mlp()
    fast = autoopt.optimize(model, (torch.randn(2, 6),))
    assert {n for n, _ in fast.named_parameters()} == {f"module.{n}" for n, _ in
                                                       model.named_parameters()}
    assert all(p is not q for p, q in zip(fast.parameters(), model.parameters(), strict=True))
    # Weights loaded into the optimized module are what its graph computes with.
    other = mlp()
    fast.module.load_state_dict(other.state_dict())
    v = torch.randn(2, 6)
    torch.testing.assert_close(fast(v), other(v))


def test_moving_the_module_drops_graphs_and_recaptures() -> None:
    fast = autoopt.optimize(mlp(), (torch.randn(2, 6),))
    fast.to(torch.float64)
    v = torch.randn(2, 6, dtype=torch.float64)
    out = fast(v)
    assert out.dtype == torch.float64
    assert len(fast.report.captures) == 2


def test_optimizing_an_optimized_or_compiled_module_uses_the_original() -> None:
    model = mlp()
    fast = autoopt.optimize(autoopt.optimize(model, (torch.randn(2, 6),)), (torch.randn(2, 6),))
    assert isinstance(fast.module, nn.Sequential)
    compiled = torch.compile(model, backend="eager")
    assert isinstance(autoopt.optimize(compiled, (torch.randn(2, 6),)).module, nn.Sequential)


def test_report_reads_as_text() -> None:
    # packed_linear's choice is measured (machine-dependent counts): left out here.
    fast = autoopt.optimize(mlp(), (torch.randn(2, 6),), disable=("packed_linear",))
    text = str(fast.report)
    assert "capture: export" in text
    assert "pass remove_noops" in text and "dropout=1" in text
    assert "verification: matched on 3 input set(s)" in text
    assert fast.report.pass_counts == {"dropout": 1}


def test_only_whole_graphs_can_be_saved(tmp_path: Path) -> None:
    class Branchy(nn.Module):
        def forward(self, v: torch.Tensor) -> torch.Tensor:
            return v + 1 if v.sum() > 0 else v - 1

    v = torch.randn(4)
    fast = autoopt.optimize(Branchy(), (v,))
    with pytest.raises(autoopt.ModelError, match="captured by 'dynamo', not as one whole graph"):
        save_program(fast, (v,), {}, str(tmp_path / "x.pt2"))


def test_inference_capture_folds_and_a_gradient_call_keeps_parameter_gradients() -> None:
    import torchvision

    model = torchvision.models.resnet18(num_classes=10).eval()
    v = torch.randn(2, 3, 64, 64)
    fast = autoopt.optimize(model, (v,))
    assert fast.report.pass_counts.get("folded_bn") == 20  # captured under no_grad
    with torch.no_grad():
        torch.testing.assert_close(fast(v), model(v), rtol=1e-4, atol=1e-4)
    assert len(fast.report.captures) == 1
    # With gradients on, the folded graph would drop the conv/bn weights' gradients.
    fast(v).sum().backward()
    assert len(fast.report.captures) == 2
    assert "folded_bn" not in fast.report.captures[1].passes[1].counts
    model(v).sum().backward()
    grads = dict(fast.module.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(grads[name].grad, p.grad, rtol=1e-4, atol=1e-4, msg=name)


def test_training_flag_captures_with_gradients() -> None:
    fast = autoopt.optimize(mlp(), (torch.randn(2, 6),), training=True)
    assert fast.report.captures[0].inputs
    assert fast.specializations[0].signature.modes[0] is True


class ConvBnMlp(nn.Module):
    """What inference passes turn into copies of the weights: a BatchNorm folded into its conv,
    linears packed (or merged)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3)
        self.bn = nn.BatchNorm2d(8)
        self.head = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.bn(self.conv(x))).mean((2, 3)))


def _randomized(model: nn.Module, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    with torch.no_grad():
        for t in (*model.parameters(), *model.buffers()):
            if t.is_floating_point():
                t.copy_(torch.rand_like(t) + 0.5)
    return model.eval()


@pytest.mark.parametrize("assign", [False, True])
def test_weights_loaded_after_an_inference_capture_are_used(assign: bool) -> None:
    """The inference graph holds folded and packed copies of the weights: after
    ``load_state_dict`` it must not compute with the old ones."""
    model, other = _randomized(ConvBnMlp(), 0), _randomized(ConvBnMlp(), 1)
    x = torch.randn(2, 3, 12, 12)
    with torch.no_grad():
        fast = autoopt.optimize(model, (x,))
        assert fast.report.pass_counts.get("folded_bn") == 1
        fast.module.load_state_dict(other.state_dict(), assign=assign)
        torch.testing.assert_close(fast(x), other(x), rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(model(x), _randomized(ConvBnMlp(), 0)(x))  # yours: as was
    # Built again: rebuilt from the exported graph (in place), captured anew (assign=True).
    assert len(fast.report.captures) + fast.report.captures[0].rebuilds == 2


def test_training_steps_then_inference_use_the_trained_weights_and_statistics() -> None:
    model = _randomized(ConvBnMlp(), 0)
    x = torch.randn(4, 3, 12, 12)
    with torch.no_grad():
        fast = autoopt.optimize(model, (x,))
        fast(x)
    fast.train()
    optimizer = torch.optim.SGD(fast.parameters(), lr=0.1)
    for _ in range(2):  # weights and BatchNorm running statistics change
        optimizer.zero_grad()
        fast(x).square().mean().backward()
        optimizer.step()
    fast.eval()
    with torch.no_grad():
        torch.testing.assert_close(fast(x), fast.module(x), rtol=1e-4, atol=1e-5)
    # The inference graph rebuilt for the new weights, from its exported graph.
    assert [c.method for c in fast.report.captures] == ["export"] * 2
    assert fast.report.captures[0].rebuilds == 1
    assert any("rebuilt" in w for w in fast.report.warnings)


def test_unchanged_weights_keep_every_graph() -> None:
    """Verifying a new shape puts back the buffers it ran through: that is no reason to
    capture the first shape again."""
    model = _randomized(ConvBnMlp(), 0)
    a, b = torch.randn(2, 3, 12, 12), torch.randn(3, 3, 12, 12)
    with torch.no_grad():
        fast = autoopt.optimize(model, (a,))
        for _ in range(2):
            torch.testing.assert_close(fast(a), model(a), rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(fast(b), model(b), rtol=1e-4, atol=1e-5)
    assert len(fast.report.captures) == 2
    assert not any(c.rebuilds for c in fast.report.captures)
    assert not any("written after" in w for w in fast.report.warnings)


def _same_memory(a: nn.Module, b: nn.Module) -> list[bool]:
    return [p.data_ptr() == q.data_ptr() for p, q in zip(a.parameters(), b.parameters(),
                                                          strict=True)]


def test_an_inference_module_reads_your_weights_without_a_copy() -> None:
    model = _randomized(ConvBnMlp(), 0)
    x = torch.randn(2, 3, 12, 12)
    with torch.no_grad():
        fast = autoopt.optimize(model, (x,))
        assert all(_same_memory(fast.module, model))
        # Your in-place edit is seen, not half seen: graphs built from the old values (the
        # folded conv, the packed linears) are rebuilt.
        model.head[0].weight.mul_(-1)
        model.bn.running_var.mul_(4)
        torch.testing.assert_close(fast(x), model(x), rtol=1e-4, atol=1e-5)
    assert len(fast.report.captures) == 1 and fast.report.captures[0].rebuilds == 1


def test_training_through_the_module_never_writes_your_weights() -> None:
    model = _randomized(ConvBnMlp(), 0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.randn(4, 3, 12, 12)
    with torch.no_grad():
        fast = autoopt.optimize(model, (x,))
    optimizer = torch.optim.SGD(fast.parameters(), lr=0.1)  # built while still shared
    fast.train()
    fast(x).square().mean().backward()
    optimizer.step()
    assert not any(_same_memory(fast.module, model))
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    # The step reached autoopt's copy: the optimizer's tensors are the module's.
    assert not torch.equal(fast.module.head[0].weight, model.head[0].weight)


def test_a_training_optimize_copies_the_weights_at_once() -> None:
    model = _randomized(ConvBnMlp(), 0).train()
    fast = autoopt.optimize(model, (torch.randn(4, 3, 12, 12),))
    assert not any(_same_memory(fast.module, model))


@pytest.mark.parametrize("mode", [False, True])
def test_the_module_reports_the_models_train_flag_and_restores_it(mode: bool) -> None:
    """An eval model's optimized module said ``training`` True (nn.Module's default), so the
    common ``was = m.training; m.eval(); ...; m.train(was)`` put the model in train mode:
    dropout and batch statistics on the next call."""
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Dropout(0.5),
                          nn.Linear(16, 4)).train(mode)
    x = torch.randn(4, 8)
    fast = autoopt.optimize(model, (x,), training=mode)
    assert fast.training is mode and fast.module.training is mode
    was = fast.training
    fast.eval()
    assert not fast.training and not fast.module.training
    fast.train(was)
    assert fast.module.training is mode and fast.module[2].training is mode
    fast.module.train(not mode)  # either side of the pair says the same
    assert fast.training is (not mode)
    fast.training = mode  # the flag alone, as on any module
    assert fast.module.training is mode and fast.module[2].training is (not mode)
    fast.train(mode)
    if not mode:
        with torch.no_grad():
            torch.testing.assert_close(fast(x), model(x))


def test_a_first_call_inside_checkpoint_captures_and_recomputes_as_eager() -> None:
    """``torch.utils.checkpoint(fast, h)`` (non-reentrant) as the first call of a new
    signature (``h`` requires grad, the example did not): the capture ran under checkpoint's
    saved-tensor hooks, which counted every tensor it saved, and backward raised
    ``CheckpointError`` (147 saved against the recompute's 21); the capture also failed and
    left that signature eager. Capture now saves its own tensors."""
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.SiLU(), nn.Linear(16, 8)).train()
    reference = copy.deepcopy(model)
    fast = autoopt.optimize(model, (torch.randn(4, 8),), training=True)
    pre, base = nn.Linear(8, 8), torch.randn(4, 8)
    grads = []
    for module in (reference, fast):
        pre.zero_grad()
        checkpoint(module, pre(base), use_reentrant=False).pow(2).sum().backward()
        grads.append((pre.weight.grad.clone(), module[0].weight.grad if module is reference
                      else fast.module[0].weight.grad))
    for got, want in zip(grads[1], grads[0], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert [c.method for c in fast.report.captures] == ["export", "export"]



def test_a_runner_skips_matching_inputs_but_not_the_modules_state() -> None:
    """``runner_for``: the graph serving one signature, called without matching the inputs
    again; a change of state (a folded buffer written in place), of mode (gradients on) or of
    flags (train mode) takes the full call, which captures for it, as ``fast(x)`` would."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.ReLU()).eval()
    x = torch.randn(4, 8)
    fast = autoopt.optimize(model, (x,))
    with torch.no_grad():
        assert fast.runner_for((torch.randn(3, 9),)) is None  # no graph serves these yet
        run = fast.runner_for((x,))
        torch.testing.assert_close(run(x), model(x))
        other = torch.randn(4, 8)
        torch.testing.assert_close(run(other), model(other))
        model[1].running_mean.add_(1.0)  # folded into the linear at capture
        torch.testing.assert_close(run(x), model(x))
    y = run(x)  # gradients on: the inference graph does not serve it
    assert y.grad_fn is not None
    torch.testing.assert_close(y, model(x))
    fast.train()
    model.train()
    with torch.no_grad():
        torch.testing.assert_close(run(x), model(x))
