"""The diagnosis and report commands of docs/diagnosis.md and docs/report.md, run as written.
Run from this folder: data.py and my_model.py are here."""

import os
import shlex
import subprocess
from pathlib import Path

os.chdir(Path(__file__).resolve().parent)
COMMANDS = """
autoopt diagnose torchvision.models:resnet18 --loader data.py:make_loader --steps 10
autoopt diagnose my_model.py:Net --input 2x128:int64 --steps 50 --apply
autoopt report my_model.py:Net --input input_ids=2x128:int64 --steps 5 -o report.html
"""
for command in COMMANDS.strip().splitlines():
    print(f"$ {command}", flush=True)
    subprocess.run(shlex.split(command), check=True)
