"""The diagnosis and report commands of docs/diagnosis.md and docs/report.md, run as written.
Run from this folder: data.py and my_model.py are here."""

import os
import shlex
from pathlib import Path

from autoopt.cli import main as autoopt_command  # the `autoopt` program, in this process

os.chdir(Path(__file__).resolve().parent)
COMMANDS = """
autoopt diagnose torchvision.models:resnet18 --loader data.py:make_loader --steps 10
autoopt diagnose my_model.py:Net --input 2x128:int64 --steps 50 --apply
autoopt report my_model.py:Net --input input_ids=2x128:int64 --steps 5 -o report.html
"""
for command in COMMANDS.strip().splitlines():
    print(f"$ {command}", flush=True)
    assert autoopt_command(shlex.split(command)[1:]) == 0, command  # as the shell runs it
