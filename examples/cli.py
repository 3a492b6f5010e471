"""The README's command-line examples, run as written, then the saved program loaded back.

Run from anywhere (``python examples/cli.py``): the commands run from the clone's root, where
the README's user types them.
"""

import os
import shlex
from pathlib import Path

import torch

from autoopt.cli import main as autoopt_command  # the `autoopt` program, in this process

os.chdir(Path(__file__).resolve().parent.parent)  # the clone's root; net.pt2 is written here
COMMANDS = """
autoopt optimize torchvision.models:resnet18 --input 1x3x224x224
autoopt optimize examples/my_model.py:Net --input input_ids=2x128:int64 --dynamic batch --save net.pt2
"""  # noqa: E501 - each command as the README writes it, on one line
for command in COMMANDS.strip().splitlines():
    print(f"$ {command}", flush=True)
    assert autoopt_command(shlex.split(command)[1:]) == 0, command  # as the shell runs it

net = torch.export.load("net.pt2").module()               # plain torch: no autoopt needed
logits = net(input_ids=torch.randint(0, 100, (8, 128)))   # named inputs: keywords only
print(logits.shape)
