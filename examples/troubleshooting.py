"""Why a model was not captured whole, and iterating quickly (docs/troubleshooting.md)."""

import torch
from torch import nn

import autoopt


class Gate(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:           # data-dependent control flow: no single graph holds both
            return torch.relu(x)
        return -x


fast = autoopt.optimize(Gate(), (torch.randn(8, 16),), backends=("aten",))  # quick to build
record = fast.report.captures[0]
print(record.method)              # dynamo: captured in pieces, the rest runs eagerly
for method, why in record.attempts:
    print(f"{method} not used: {why}")
print(fast.report.warnings)       # eager fallbacks, the specialization limit, ...
