"""A model cut into pipeline stages, one per device, balanced by measured time (README
"Pipelines", docs/pipelines.md). Both "devices" here are the CPU; on a machine with two GPUs
write devices=["cuda:0", "cuda:1"]."""

import shlex

import torch
from torch import nn

import autoopt
from autoopt.cli import main as autoopt_command  # the `autoopt` program, in this process

blocks = [nn.Sequential(nn.Linear(256, 256), nn.GELU()) for _ in range(8)]
model = nn.Sequential(*blocks, nn.Linear(256, 10))     # train mode: a training pipeline
x, target = torch.randn(8, 256), torch.randint(0, 10, (8,))
pipe = autoopt.optimize(model, (x,), devices=["cpu", "cpu"], microbatches=4)
print(pipe.table())            # per stage: time, transfer, memory, boundary tensors
y = pipe(x)                    # GPipe over 4 microbatches of 2
loss = pipe.train_step((x,), target, nn.functional.cross_entropy, schedule="1f1b")
print(y.shape, float(loss))

# The cut alone, from the command line: the stage table, and a chart of each stage's time
# and memory (--devices names one device per stage; default: the CPU for each).
COMMANDS = """
autoopt partition my_model.py:Net --input input_ids=2x128:int64 --stages 2 --plot stages.png
"""
for command in COMMANDS.strip().splitlines():
    print(f"$ {command}", flush=True)
    assert autoopt_command(shlex.split(command)[1:]) == 0, command  # as the shell runs it
