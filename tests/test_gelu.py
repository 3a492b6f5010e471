"""gelu: GELU spelled out elementwise → one aten.gelu."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from autoopt.capture.graph import export_graph, symbolic_trace_graph
from autoopt.passes import PassContext, replace_gelu

aten = torch.ops.aten


class Before(nn.Module):
    """GPT-2's NewGELUActivation and the exact erf form, side by side."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tanh_form = 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi)
                                                * (x + 0.044715 * torch.pow(x, 3.0))))
        erf_form = x * 0.5 * (1.0 + torch.erf(x / math.sqrt(2.0)))
        return tanh_form - erf_form


class Expected(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(x, approximate="tanh") - F.gelu(x)


def _targets(gm: torch.fx.GraphModule) -> list[object]:
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def test_before_becomes_expected_and_matches_eager() -> None:
    x = torch.randn(4, 64)
    result = replace_gelu(export_graph(Before(), (x,), {}), PassContext())
    assert result.counts == {"gelu_tanh": 1, "gelu_erf": 1}
    assert _targets(result.graph_module) == _targets(export_graph(Expected(), (x,), {}))
    for _ in range(3):
        y = torch.randn(4, 64) * 3
        torch.testing.assert_close(result.graph_module(y), Before()(y), rtol=1e-5, atol=1e-5)


def test_gpt2_activation_module_at_function_level() -> None:
    from transformers.activations import NewGELUActivation

    x = torch.randn(2, 8, 32)
    gm, positional = symbolic_trace_graph(NewGELUActivation(), (x,), {})
    result = replace_gelu(gm, PassContext())
    assert result.counts == {"gelu_tanh": 1}
    torch.testing.assert_close(gm(*positional(x)), F.gelu(x, approximate="tanh"))


@pytest.mark.parametrize("case", ["wrong_constant", "intermediate_reused", "integer_input"])
def test_does_not_fire_on_near_misses(case: str) -> None:
    class M(nn.Module):
        def forward(self, x: torch.Tensor) -> object:
            if case == "integer_input":
                x = x.to(torch.int64)
                return x * 0.5 * (1.0 + torch.erf(x / math.sqrt(2.0)))
            c = 0.05 if case == "wrong_constant" else 0.044715
            inner = x + c * torch.pow(x, 3.0)
            y = 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * inner))
            return (y, inner) if case == "intermediate_reused" else y

    gm = export_graph(M(), (torch.randn(8) * 4,), {})
    result = replace_gelu(gm, PassContext())
    assert not result.modified
    assert aten.gelu.default not in _targets(result.graph_module)
