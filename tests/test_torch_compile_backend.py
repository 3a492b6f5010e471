"""autoopt as a named torch.compile backend."""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import autoopt
from autoopt.capture.graph import annotate, symbolic_trace_graph


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.dropout = nn.Dropout(0.2)

    def forward(self, v: torch.Tensor) -> torch.Tensor:
        h = self.dropout(self.linear(v))
        if h.mean() > 0:  # a graph break: two subgraphs
            return h * 1 + 0
        return -h


def test_backend_is_registered_by_name() -> None:
    torch._dynamo.reset()
    from torch._dynamo.backends.registry import list_backends

    assert "autoopt" in list_backends(exclude_tags=())


def test_compile_with_named_backend_matches_eager() -> None:
    torch._dynamo.reset()
    model = Net().eval()
    compiled = torch.compile(model, backend="autoopt")
    for _ in range(3):
        v = torch.randn(4, 8)
        torch.testing.assert_close(compiled(v), model(v))


def test_backend_runs_the_pipeline_and_records_it() -> None:
    torch._dynamo.reset()
    record = autoopt.CaptureRecord(inputs="test")
    seen: list[torch.fx.GraphModule] = []

    def backend(gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]):  # noqa: ANN202
        optimized = autoopt.autoopt_backend(gm, example_inputs, record=record)
        seen.append(optimized)
        return optimized

    model = Net().eval()
    compiled = torch.compile(model, backend=backend)
    v = torch.ones(4, 8)
    with torch.no_grad():
        model.linear.bias.fill_(1.0)
    torch.testing.assert_close(compiled(v), model(v))
    assert record.subgraphs == len(seen) >= 1
    statuses = {r.name: r.status for r in record.passes}
    assert statuses["remove_noops"] == "applied"
    assert record.passes[0].counts.get("dropout") == 1


def test_backend_options_are_checked_and_applied() -> None:
    torch._dynamo.reset()
    model = Net().eval()
    compiled = torch.compile(model, backend="autoopt", options={"disable": ["remove_noops"]})
    v = torch.randn(4, 8)
    torch.testing.assert_close(compiled(v), model(v))


# --- Graphs that write tensors in place: run once per call, never at compile time --------------

def _no_passes() -> dict[str, object]:
    return {"verify": False, "disable": list(autoopt.passes.PASS_NAMES)}


class WritesInput(nn.Module):
    """``x[:, 0] = 1`` is a setitem node, which Dynamo gives no example value."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x[:, 0] = 1
        x.mul_(2)
        return x.sum(1)


def test_a_graph_that_writes_its_input_writes_it_once() -> None:
    torch._dynamo.reset()
    compiled = torch.compile(WritesInput(), backend="autoopt", options=_no_passes())
    x, x_eager = torch.ones(2, 3), torch.ones(2, 3)
    torch.testing.assert_close(compiled(x), WritesInput()(x_eager))  # 6, not 10
    torch.testing.assert_close(x, x_eager)


class SetitemAfterBatchNorm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.bn = nn.BatchNorm1d(3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.bn(x).clone()
        h[:, 0] = 0
        return h


def test_compiling_does_not_update_batchnorm_statistics() -> None:
    torch._dynamo.reset()
    model, twin = SetitemAfterBatchNorm().train(), SetitemAfterBatchNorm().train()
    x = torch.randn(4, 3)
    torch.compile(model, backend="autoopt", options=_no_passes())(x)
    twin(x)
    assert int(model.bn.num_batches_tracked) == 1
    torch.testing.assert_close(model.bn.running_mean, twin.bn.running_mean)
    torch.testing.assert_close(model.bn.running_var, twin.bn.running_var)


def test_annotation_of_a_graph_fake_tensors_cannot_follow_leaves_inputs_alone() -> None:
    """``.item()`` has no fake value: the graph is recorded from a run on copies instead."""

    class ScaleBySum(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x.mul_(2)
            return x * x.sum().item()

    gm = torch.fx.symbolic_trace(ScaleBySum())
    x = torch.ones(3)
    annotate(gm, [x])
    torch.testing.assert_close(x, torch.ones(3))
    assert all("val" in n.meta for n in gm.graph.nodes if n.op != "output")
    assert tuple(next(n for n in gm.graph.nodes if n.op == "output").args[0].meta["val"].shape) \
        == (3,)


class Counter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("count", torch.zeros((), dtype=torch.long))
        self.register_buffer("ema", torch.zeros(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.count.add_(1)
        self.ema.mul_(0.9).add_(x.mean(0), alpha=0.1)
        return x * 2


def test_in_place_buffer_updates_survive_dead_code() -> None:
    torch._dynamo.reset()
    model, twin = Counter(), Counter()
    compiled = torch.compile(model, backend="autoopt", options={"verify": False})
    for _ in range(3):
        x = torch.randn(2, 4)
        torch.testing.assert_close(compiled(x), twin(x))
    assert int(model.count) == int(twin.count) == 3
    torch.testing.assert_close(model.ema, twin.ema)


class ConvBatchNorm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.bn = nn.BatchNorm2d(4)
        self.dropout = nn.Dropout(0.0)  # p=0: remove_noops applies, so verification runs

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.bn(self.conv(x))).relu()


def test_train_mode_batchnorm_under_compile_rolls_nothing_back() -> None:
    """num_batches_tracked.add_(1) has no users; erasing it made every compile of a BatchNorm
    training model fail verification ("integer/bool values differ") and roll passes back."""
    torch._dynamo.reset()
    record = autoopt.CaptureRecord(inputs="test")
    backend = functools.partial(autoopt.autoopt_backend, record=record)
    model, twin = ConvBatchNorm().train(), ConvBatchNorm().train()
    twin.load_state_dict(model.state_dict())
    compiled = torch.compile(model, backend=backend)
    for _ in range(2):
        x = torch.randn(2, 3, 8, 8)
        torch.testing.assert_close(compiled(x), twin(x))
    statuses = {r.name: r.status for r in record.passes}
    assert statuses["remove_noops"] == "applied"
    assert "rolled_back" not in statuses.values(), record.passes
    assert int(model.bn.num_batches_tracked) == 2
    torch.testing.assert_close(model.bn.running_mean, twin.bn.running_mean)


# --- Symbolic shapes: verification runs on concrete sizes --------------------------------------

class FlattenGelu(nn.Module):
    """A flatten by the (possibly symbolic) batch size, then a GELU written out, which the gelu
    pass rewrites at any shape: a pass applies, so verification runs."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(12, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.linear(x.view(x.shape[0], -1))
        return 0.5 * h * (1.0 + torch.tanh(0.7978845608028654 * (h + 0.044715 * h ** 3)))


def _compile_recording(model: nn.Module, **compile_options: Any,
                       ) -> tuple[Callable[..., Any], list[tuple[bool, autoopt.CaptureRecord]]]:
    """``model`` compiled with autoopt; per subgraph, whether Dynamo gave it a symbolic size,
    and its record."""
    records: list[tuple[bool, autoopt.CaptureRecord]] = []

    def backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        symbolic = any(isinstance(x, torch.SymInt) for x in example_inputs)
        records.append((symbolic, autoopt.CaptureRecord(inputs="test")))
        return autoopt.autoopt_backend(gm, example_inputs, record=records[-1][1])

    return torch.compile(model, backend=backend, **compile_options), records


def _gelu_applied(record: autoopt.CaptureRecord) -> bool:
    return any(r.name == "gelu" and r.status == "applied" for r in record.passes)


@pytest.mark.parametrize("how", ["automatic", "dynamic=True", "mark_dynamic"])
def test_symbolic_batch_size_is_verified_with_a_pass_applied(how: str) -> None:
    torch._dynamo.reset()
    model = FlattenGelu().eval()
    compiled, records = _compile_recording(model, dynamic=True if how == "dynamic=True" else None)
    for batch in (2, 3, 5):
        x = torch.randn(batch, 3, 4)
        if how == "mark_dynamic":
            torch._dynamo.mark_dynamic(x, 0)
        torch.testing.assert_close(compiled(x), model(x))
    # The pass applied on a symbolic graph, so verification ran on it (with the default
    # verify=True): that run is what met the SymInt.
    assert any(symbolic and _gelu_applied(record) for symbolic, record in records)
    assert all(_gelu_applied(record) for _, record in records)


class BranchyGelu(FlattenGelu):
    """FlattenGelu with data-dependent control flow: neither export nor symbolic_trace takes
    it, so ``optimize`` captures it with Dynamo."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = super().forward(x)
        if h.sum() > 0:
            return h * 2
        return h


@pytest.mark.parametrize("dynamic", [False, True])
def test_optimize_through_dynamo_serves_new_batch_sizes(dynamic: bool) -> None:
    """A new batch size makes Dynamo recompile with a symbolic size (automatic dynamic shapes,
    or from the start with dynamic=True); the model must stay compiled, not fail or fall back
    to eager."""
    torch._dynamo.reset()
    model = BranchyGelu().eval()
    fast = autoopt.optimize(model, (torch.randn(2, 3, 4),), dynamic=dynamic)
    (record,) = fast.report.captures
    assert record.method == "dynamo", record.attempts
    before = {r.name: dict(r.counts) for r in record.passes}["gelu"].get("gelu_tanh", 0)
    for batch in (3, 5, 2):
        x = torch.randn(batch, 3, 4)
        torch.testing.assert_close(fast(x), model(x))
    after = {r.name: dict(r.counts) for r in record.passes}["gelu"].get("gelu_tanh", 0)
    assert before >= 1
    if not dynamic:  # the recompile at a symbolic size applied the pass, and was verified
        assert after > before


# --- symbolic_trace capture: buffer writes are in the graph or refused -------------------------

class SizedByBuffer(nn.Module):
    """A buffer's size steers Python, so it must be traced as the real tensor."""

    def __init__(self, write: bool) -> None:
        super().__init__()
        self.write = write
        self.register_buffer("table", torch.ones(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.write:
            self.table.add_(1)
        for i in range(self.table.size(0)):
            x = x + self.table[i]
        return x


def test_symbolic_trace_reads_a_buffer_that_steers_python() -> None:
    model = SizedByBuffer(write=False)
    gm, _ = symbolic_trace_graph(model, (torch.zeros(2),), {})
    torch.testing.assert_close(gm(torch.zeros(2)), model(torch.zeros(2)))


def test_symbolic_trace_refuses_to_write_a_buffer_at_trace_time() -> None:
    model = SizedByBuffer(write=True)
    with pytest.raises(TypeError, match="writes buffer table"):
        symbolic_trace_graph(model, (torch.zeros(2),), {})
    torch.testing.assert_close(model.table, torch.ones(3))  # tracing left it as it was


def test_a_subgraph_with_a_library_kernel_is_verified_on_its_example_only() -> None:
    """torchvision's roi_align reads a box's batch index unchecked: a random box indexes out
    of bounds (it crashed the process), so such a subgraph is compared on the example inputs
    alone; one of ATen ops only also on random ones."""
    import torchvision

    from autoopt.compile.dynamo import verify_graph

    class Pool(torch.nn.Module):
        def forward(self, x: torch.Tensor, boxes: torch.Tensor) -> torch.Tensor:
            return torch.ops.torchvision.roi_align.default(x, boxes, 1.0, 2, 2, 2, False)

    assert torchvision.ops is not None
    x, boxes = torch.randn(2, 3, 8, 8), torch.tensor([[1.0, 0.0, 0.0, 4.0, 4.0]])
    gm = torch.fx.symbolic_trace(Pool())
    config = autoopt.OptimizeConfig()
    assert verify_graph(gm, gm, [x, boxes], config).inputs_checked == 1
    plain = torch.fx.symbolic_trace(torch.nn.Sequential(torch.nn.ReLU()))
    assert verify_graph(plain, plain, [x], config).inputs_checked == 1 + config.random_inputs


class _Checkpointed(nn.Module):
    """``torch.utils.checkpoint`` around dropout: the backward recomputes the region."""

    def __init__(self) -> None:
        super().__init__()
        self.block = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Dropout(0.5),
                                   nn.Linear(16, 16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.utils.checkpoint.checkpoint(self.block, x, use_reentrant=False)


def test_a_checkpointed_region_recomputes_with_the_forwards_dropout_masks() -> None:
    """Dynamo leaves the random state's preservation to AOTAutograd; run as it was, the
    recompute drew new masks: the forward exact, the gradients off by their whole scale."""
    model = _Checkpointed().train()
    x = torch.randn(8, 16)
    grads = []
    for backend in (None, "autoopt"):
        torch._dynamo.reset()
        m = copy.deepcopy(model)
        run = m if backend is None else torch.compile(m, backend=backend)
        torch.manual_seed(123)
        out = run(x)
        out.pow(2).sum().backward()
        grads.append((out.detach(), [p.grad for p in m.parameters()]))
    (expected, expected_grads), (actual, actual_grads) = grads
    torch.testing.assert_close(actual, expected)
    torch.testing.assert_close(actual_grads, expected_grads)
