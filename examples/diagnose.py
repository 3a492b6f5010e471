"""Why the device is idle, the fixes tried, and asynchronous loading (README "Why is the device
idle?", docs/diagnosis.md). Run from this folder: data.py is here."""

import torch
from data import make_loader
from torch import nn

import autoopt

model = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                      nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10))
loader = make_loader()                    # a DataLoader of (image, label) batches
opt = torch.optim.AdamW(model.parameters())
diagnosis = autoopt.diagnose(model, loader, training=True, optimizer=opt, steps=4)
print(diagnosis)                          # causes ranked by share of step time, with fixes
print(diagnosis.apply())                  # optimize with the fixes; before/after step time

for x, y in autoopt.data.prefetch(loader, "cpu", depth=2):   # CUDA: pinned, side-stream copies
    loss = nn.functional.cross_entropy(model(x), y)
