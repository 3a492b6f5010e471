"""The ``autoopt`` command line: one module per command, each with ``add_parser(sub)`` and
``run(args) -> int``; ``common`` holds the preamble they share (MODEL, ``--input``, sizes, pass
names), ``progress`` what a command shows while it works."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from ..errors import AutoOptError
from . import diagnose, export, generate, optimize, partition, profile, report, run
from .progress import shown

# In the order ``autoopt --help`` lists them.
COMMANDS = {"optimize": optimize, "profile": profile, "export": export, "run": run,
            "diagnose": diagnose, "report": report, "partition": partition,
            "generate": generate}
# Commands that draw their own progress bars (tqdm): a status line would fight them.
_OWN_PROGRESS = {"diagnose", "report"}


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("autoopt")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown (not installed; pip install -e .)"


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="autoopt", description="Optimize PyTorch models: "
                                  "capture, rewrite, verify against eager, export.")
    top.add_argument("--version", action="version", version=f"autoopt {_version()}")
    sub = top.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in COMMANDS.values():
        command.add_parser(sub)
    return top


def main(argv: Sequence[str] | None = None) -> int:
    """Run one ``autoopt`` command; 0 on success, 2 for a usage or input error (the message
    on stderr)."""
    args = parser().parse_args(argv)
    with shown(args.command, args.verbose, status_line=args.command not in _OWN_PROGRESS):
        try:
            return COMMANDS[args.command].run(args)
        except AutoOptError as exc:
            error = exc
    print(f"autoopt: error: {error}", file=sys.stderr)  # after the status line is erased
    return 2
