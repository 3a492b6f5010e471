"""Each op's int8 error alone (passes/int8_sensitivity.py): what the static int8 refusal and
the ops kept in floating point are ranked by."""

from __future__ import annotations

import torch
from torch import nn

from autoopt.passes import int8_sensitivity


class Outlier(nn.Module):
    """Two linears; the second reads an activation with one channel 1000x the others, which
    a per-tensor uint8 scale rounds the small channels of to nothing, and which it does not
    use (its weight there is zero): its output is all the small channels'."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(16, 16)
        self.second = nn.Linear(16, 4)
        self.register_buffer("gain", torch.ones(16))
        self.gain[0] = 1000.0
        with torch.no_grad():
            self.second.weight[:, 0] = 0.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(torch.relu(self.first(x)) * self.gain)


def graph() -> tuple[torch.fx.GraphModule, torch.Tensor]:
    torch.manual_seed(0)
    model, x = Outlier().eval(), torch.randn(8, 16)
    return torch.export.export(model, (x,)).module(), x


def test_the_op_reading_the_outlier_errs_most_and_is_blamed() -> None:
    gm, x = graph()
    ops = [n.name for n in int8_sensitivity.quantized_ops(gm)]
    assert len(ops) == 2
    ranges = int8_sensitivity.observe(gm, [[torch.randn(8, 16)] for _ in range(4)])
    assert all(lo <= 0.0 <= hi for lo, hi in ranges.values())
    found = int8_sensitivity.errors(gm, ranges, [[x]])
    first, second = ops
    assert found[second] > 10 * found[first] > 0
    assert int8_sensitivity.blamed(found, tolerance=found[first] * 2) == [(second, found[second])]
    # None beyond the tolerance: the worst are named all the same, worst first.
    assert [n for n, _ in int8_sensitivity.blamed(found, tolerance=1.0)] == [second, first]


def test_attention_is_measured_with_its_probabilities_rounded() -> None:
    class Attention(nn.Module):
        def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

    q, k, v = (torch.randn(1, 2, 8, 4) for _ in range(3))
    gm = torch.export.export(Attention(), (q, k, v)).module()
    (op,) = int8_sensitivity.quantized_ops(gm)
    ranges = int8_sensitivity.observe(gm, [[q, k, v]])
    assert {i for name, i in ranges if name == op.name} == {0, 1, 2}
    error = int8_sensitivity.errors(gm, ranges, [[q, k, v]])[op.name]
    assert 0 < error < 0.1  # rounded, and still attention's output
