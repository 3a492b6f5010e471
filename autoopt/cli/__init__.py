"""The ``autoopt`` command line: one module per command, each with ``add_parser(sub)`` and
``run(args) -> int``; ``common`` holds the preamble they share (MODEL, ``--input``, sizes, pass
names), ``progress`` what a command shows while it works."""

from __future__ import annotations

import argparse
import atexit
import os
import sys
import threading
from collections.abc import Sequence

from autoopt.cli import diagnose, export, generate, optimize, partition, profile, report, run
from autoopt.cli.progress import shown
from autoopt.errors import AutoOptError

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
    on stderr).

    Without ``argv`` this is the program (the console script, ``python -m autoopt``): it reads
    ``sys.argv`` and ends the process when the command is done, see ``_exit``."""
    code = _run(argv)
    if argv is None:
        _exit(code)
    return code


def _exit(code: int) -> None:
    """End the process as the interpreter would, less the module teardown.

    With torch, Inductor and ONNX Runtime loaded, tearing down the interpreter's thousands of
    modules kept the shell waiting 2-10 s after the result was printed. Everything the command
    writes is written and closed when it returns; what exit still does, done here: signal and
    join the worker threads (thread pools' shutdown), run the atexit handlers (worker process
    pools, logging's flush), flush the streams. Then ``os._exit``: nothing is left to tear
    down that anyone would see."""
    shutdown = getattr(threading, "_shutdown", None)  # what Py_Finalize calls first
    if shutdown is not None:
        shutdown()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe (| head): nothing more can be shown
            code = code or 1
    os._exit(code)


def _run(argv: Sequence[str] | None) -> int:
    args = parser().parse_args(argv)
    try:  # an error leaves the block: its progress ends without "done"
        with shown(args.command, args.verbose, status_line=args.command not in _OWN_PROGRESS):
            return COMMANDS[args.command].run(args)
    except AutoOptError as exc:
        error = exc
    print(f"autoopt: error: {error}", file=sys.stderr)  # after the status line is erased
    return 2
