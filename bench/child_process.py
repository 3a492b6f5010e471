"""A measurement made in a fresh Python process (cold caches, no state from earlier rows): the
child prints its result as one marked line of JSON, the parent reads it back."""

from __future__ import annotations

import json
import subprocess
from typing import Any

MARK = "AUTOOPT_CHILD_RESULT "


def report(result: dict[str, Any]) -> None:
    """In the child: hand ``result`` to the parent."""
    print(MARK + json.dumps(result), flush=True)


def run(command: list[str], env: dict[str, str], timeout_s: float) -> dict[str, Any]:
    """In the parent: the child's result, or ``{"error": why there is none}``."""
    try:
        done = subprocess.run(command, env=env, capture_output=True, text=True,
                              timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"error": f"stopped after {timeout_s:.0f} s"}
    lines = [line for line in done.stdout.splitlines() if line.startswith(MARK)]
    if done.returncode != 0 or not lines:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return {"error": f"exit {done.returncode}: {tail}"}
    return json.loads(lines[-1][len(MARK):])
