"""The cost model: device facts, per-node measured costs, predictions (docs/design.md).
Then the same from the command line with ``autoopt profile``."""

import shlex

import torch
import torchvision

from autoopt.capture import export_graph
from autoopt.cli import main as autoopt_command  # the `autoopt` program, in this process
from autoopt.cost_model import CostModel, device_info

model, x = torchvision.models.resnet18().eval(), torch.randn(1, 3, 64, 64)
info = device_info("cpu")                 # name, memory, threads, measured ceilings
cost = CostModel("cpu")                   # or "cuda:0"
gm = export_graph(model, (x,), {})
profile = cost.profile(gm, [x])           # times every node alone on its real inputs
print(profile.latency_s, profile.peak_activation_bytes, profile.by_node["conv2d"].bound)
conv = next(node for node in gm.graph.nodes if node.name == "conv2d")
print(cost.estimate(conv))                # a cached measurement, else a calibrated roofline
print(cost.predict(gm).latency_s)         # a whole graph, or predict(gm, nodes): a stage

COMMANDS = """
autoopt profile torchvision.models:resnet18 --input 1x3x64x64 --top 10 --json costs.json
"""
for command in COMMANDS.strip().splitlines():
    print(f"$ {command}", flush=True)
    assert autoopt_command(shlex.split(command)[1:]) == 0, command  # as the shell runs it
