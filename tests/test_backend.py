"""autoopt as a named torch.compile backend."""

from __future__ import annotations

import torch
from torch import nn

import autoopt


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
