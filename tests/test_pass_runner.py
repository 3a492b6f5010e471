"""The pass driver: rollback of raising or wrong passes, disabling by name, debug checks."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.fx import GraphModule

import autoopt
from autoopt.passes import PASS_NAMES, PIPELINE, PassContext, PassResult

aten = torch.ops.aten


class Small(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.dropout = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.dropout(self.linear(x)))


def raising_pass(gm: GraphModule, ctx: PassContext) -> PassResult:
    raise RuntimeError("injected failure")


def sign_flipping_pass(gm: GraphModule, ctx: PassContext) -> PassResult:
    """Replaces relu by its negation: a wrong rewrite that verification must catch."""
    count = 0
    for node in gm.graph.nodes:
        if node.target is aten.relu.default:
            with gm.graph.inserting_after(node):
                neg = gm.graph.call_function(aten.neg.default, (node,))
            node.replace_all_uses_with(neg, delete_user_cb=lambda user, neg=neg: user is not neg)
            count += 1
    return PassResult(gm, count > 0, {"flipped": count})


def lint_breaking_pass(gm: GraphModule, ctx: PassContext) -> PassResult:
    """Uses a node before it is defined."""
    nodes = [n for n in gm.graph.nodes if n.op == "call_function"]
    nodes[0].args = (nodes[-1], *nodes[0].args[1:])
    return PassResult(gm, True, {"broken": 1})


@pytest.mark.parametrize("debug", [False, True])
def test_bad_passes_are_rolled_back_and_the_good_ones_still_apply(debug: bool) -> None:
    pipeline = (("raises", raising_pass), *PIPELINE[:1], ("flips_sign", sign_flipping_pass),
                ("breaks_lint", lint_breaking_pass), *PIPELINE[1:])
    model = Small().eval()
    x = torch.randn(4, 8)
    fast = autoopt.optimize(model, (x,), pipeline=pipeline, debug=debug)
    statuses = {r.name: r.status for r in fast.report.captures[0].passes}
    assert statuses.pop("remove_noops") == "applied"
    assert {statuses.pop(name) for name in PASS_NAMES[1:]} <= {"unchanged", "applied"}
    assert statuses == {"raises": "failed", "flips_sign": "rolled_back", "breaks_lint": "failed"}
    assert fast.report.rolled_back == ["breaks_lint", "flips_sign", "raises"]
    record = next(r for r in fast.report.captures[0].passes if r.name == "raises")
    assert "injected failure" in record.reason
    torch.testing.assert_close(fast(x), model(x))
    assert "flips_sign" in str(fast.report) and "rolled_back" in str(fast.report)


def test_passes_can_be_disabled_by_name() -> None:
    fast = autoopt.optimize(Small().eval(), (torch.randn(4, 8),), disable=["remove_noops"])
    statuses = {r.name: r.status for r in fast.report.captures[0].passes}
    assert statuses["remove_noops"] == "disabled"
    gm = fast.specializations[0].graph
    assert aten.dropout.default in [n.target for n in gm.graph.nodes]


def test_without_verification_a_wrong_pass_is_not_caught() -> None:
    # Shows the check above is what catches it, not something else in the driver.
    pipeline = (("flips_sign", sign_flipping_pass),)
    model = Small().eval()
    x = torch.randn(4, 8)
    fast = autoopt.optimize(model, (x,), pipeline=pipeline, verify=False)
    torch.testing.assert_close(fast(x), -model(x))


def _unchanging_pass(gm: GraphModule, ctx: PassContext) -> PassResult:
    return PassResult(gm, False)


def test_only_the_graph_returned_has_its_code_generated(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each pass works on a lazy copy: a pass that changes nothing, and a rewrite followed by
    another pass's copy, cost no code generation; the graph the pipeline hands on has its
    code, with the rewrite in it (exporters and Dynamo read it), and computes the rewrite."""
    from autoopt.compile.pass_runner import run_pipeline
    from autoopt.passes.graph import copy_graph_module

    gm = autoopt.capture.export_graph(Small().eval(), (torch.randn(4, 8),), {})
    generated: list[int] = []
    real = GraphModule.recompile  # a lazy module's real one too (``_real_recompile``)
    monkeypatch.setattr(GraphModule, "recompile",
                        lambda self: generated.append(id(self)) or real(self))
    passes = [("a", _unchanging_pass), ("flips_sign", sign_flipping_pass),
              ("b", _unchanging_pass), ("c", _unchanging_pass)]
    out, records = run_pipeline(gm, passes, PassContext(), check=None)
    assert [r.status for r in records] == ["unchanged", "applied", "unchanged", "unchanged"]
    assert generated == [id(out)]  # once, for the graph returned
    assert "neg" in out.code
    x = torch.randn(4, 8)
    torch.testing.assert_close(out(x), -gm(x))
    copy = copy_graph_module(gm, lazy=True)
    assert generated == [id(out)] and copy(x).equal(gm(x))  # a lazy copy runs when called


class _Counting(nn.Module):
    """An eval-mode forward that counts its calls in a buffer and adds the count."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = nn.Linear(8, 16), nn.Linear(16, 4)
        self.register_buffer("count", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.count.add_(1)
        return self.second(torch.relu(self.first(x))) + self.count


@torch.no_grad()
def test_a_forward_that_writes_buffers_pipelines_whole_batches_only() -> None:
    """Over one microbatch the pipeline was refused as "depending on how the batch is split"
    (eager's reference run had advanced the counter the stages read); over two, each
    microbatch wrote the buffers (the counter moved by 2 a call), unverified."""
    import copy

    torch.manual_seed(0)
    model, x = _Counting().eval(), torch.randn(4, 8)
    twin = copy.deepcopy(model)
    pipe = autoopt.optimize(model, (x,), devices=["cpu", "cpu"], microbatches=1)
    for _ in range(3):
        x = torch.randn(4, 8)
        torch.testing.assert_close(pipe(x), twin(x))
    with pytest.raises(autoopt.ConfigError, match="writes count on every call; a pipeline over "
                                                  "2 microbatches would write them once per"):
        autoopt.optimize(model, (x,), devices=["cpu", "cpu"], microbatches=2)
