"""dead_code: erase unused pure nodes, keep in-place updates and guards."""

from __future__ import annotations

import torch
from torch import nn

from autoopt.capture import export_graph
from autoopt.passes import PassContext, eliminate_dead_code

aten = torch.ops.aten


class Before(nn.Module):
    """x ─ sin ─ y, with cos(x) computed and dropped."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        unused = x.cos()  # noqa: F841 - the dead branch under test
        return x.sin()


def test_removes_unused_nodes_and_keeps_the_function() -> None:
    x = torch.randn(5)
    gm = export_graph(Before(), (x,), {})
    result = eliminate_dead_code(gm, PassContext())
    targets = [n.target for n in result.graph_module.graph.nodes if n.op == "call_function"]
    assert targets == [aten.sin.default]
    assert result.counts == {"dead_nodes": 1}
    y = torch.randn(5)
    torch.testing.assert_close(result.graph_module(y), y.sin())


def test_keeps_batchnorm_statistics_updates_in_training() -> None:
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)).train()
    x = torch.randn(2, 3, 8, 8)
    gm = export_graph(model, (x,), {})
    gm = eliminate_dead_code(gm, PassContext()).graph_module
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert aten.add_.Tensor in targets  # num_batches_tracked += 1 has no users but must stay
    before = gm.get_buffer("1.running_mean").clone()
    gm(x)
    assert not torch.equal(gm.get_buffer("1.running_mean"), before)
    assert int(gm.get_buffer("1.num_batches_tracked")) == 1
