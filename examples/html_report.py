"""The HTML report: optimize, diagnose the model and the optimized module, time them, and write
one self-contained file (docs/diagnosis.md, docs/report.md)."""

import torch
from torch import nn

import autoopt

model = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                      nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10)).eval()
x = torch.randn(8, 3, 32, 32)
fast = autoopt.optimize(model, (x,), report="report.html")   # charts inlined, no scripts
