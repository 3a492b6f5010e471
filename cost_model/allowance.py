"""How much memory ``optimize`` may still add: what is free on the device and what the user's
``optimize_memory`` leaves. Steps that copy weights (a pass's merged or packed weights, a
backend candidate, verification's kept outputs) ask before they run and are left out, with
the reason kept for the report, where they would not fit: never an out-of-memory crash.

The allowance of the capture under way is per thread (``allowing`` sets it, ``allowance``
reads it), so passes ask for it without being handed it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

log = logging.getLogger(__name__)

_GIB = 2**30
_local = threading.local()


def _page_size() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 4096


_PAGE = _page_size()


def rss_bytes() -> int:
    """The process's resident set size now (``/proc/self/statm``), 0 where unknown."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * _PAGE
    except (OSError, ValueError, IndexError):
        return 0


# Free memory kept back from every step: the OS, other processes, the allocator's slack.
_RESERVE = 256 * 2**20


def free_bytes(device: torch.device | str = "cpu") -> int | None:
    """Memory free for new allocations on ``device``: ``MemAvailable`` (``/proc/meminfo``) on a
    CPU, ``torch.cuda.mem_get_info`` on a CUDA device; None where the OS does not say."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0] if torch.cuda.is_available() else None
    return proc_kib("/proc/meminfo", "MemAvailable")


def proc_kib(path: str, key: str) -> int | None:
    """A ``key:  N kB`` line of a ``/proc`` file, in bytes; None where there is none."""
    try:
        with open(path) as f:
            match = re.search(rf"{key}:\s+(\d+) kB", f.read())
    except OSError:
        return None
    return int(match.group(1)) * 1024 if match else None


def _in_use(device: torch.device) -> int:
    """What the process holds on ``device``: resident memory, or CUDA memory allocated."""
    if device.type == "cuda" and torch.cuda.is_available():
        return torch.cuda.memory_allocated(device)
    return rss_bytes()


@dataclass
class Allowance:
    """How much memory ``optimize`` may add while it captures one input signature.

    Args:
        device: where the model's memory is (resident memory on a CPU, CUDA memory on a GPU).
        limit: bytes optimize may hold beyond ``start`` (``optimize_memory``); None: whatever
            is free.
        start: what the process held on ``device`` when the capture began.
        notes: each step left out or done in pieces for memory, for the report.
    """

    device: torch.device
    limit: int | None = None
    start: int = 0
    notes: list[str] = field(default_factory=list)

    def room(self) -> int | None:
        """Bytes a step may still add: what the limit leaves and what is free, less a
        reserve; None where neither is known."""
        rooms = [r for r in self._rooms().values() if r is not None]
        return max(0, min(rooms)) if rooms else None

    def _rooms(self) -> dict[str, int | None]:
        left = (None if self.limit is None
                else self.limit - max(0, _in_use(self.device) - self.start))
        free = free_bytes(self.device)
        return {"limit": left, "free": None if free is None else free - _RESERVE}

    def shortfall(self, need: int, step: str, note: bool = True) -> str:
        """'' where a step that adds about ``need`` bytes fits, else why not (with ``note``,
        also kept for the report as ``step: why``)."""
        rooms = self._rooms()
        known = {k: max(0, r) for k, r in rooms.items() if r is not None}
        if need <= 0 or not known or need <= min(known.values()):
            return ""
        if "limit" in known and known["limit"] <= known.get("free", known["limit"]):
            left = f"optimize_memory={size(self.limit)} leaves {size(known['limit'])}"
        else:
            left = f"{size(known['free'])} is free on the {self.device.type}"
        why = f"needs about {size(need)} and {left}"
        if note and not any(n.startswith(f"{step}:") for n in self.notes):
            self.notes.append(f"{step}: {why}")
        log.info("memory: %s: %s", step, why)
        return why


def size(nbytes: int) -> str:
    """``nbytes`` for a person: GiB from one GiB up, MiB from one MiB, KiB, else bytes."""
    if abs(nbytes) >= _GIB:
        return f"{nbytes / _GIB:.2f} GiB"
    if abs(nbytes) >= 2**20:
        return f"{nbytes / 2**20:.0f} MiB"
    return f"{nbytes / 2**10:.0f} KiB" if abs(nbytes) >= 2**10 else f"{nbytes} B"


def allowance() -> Allowance:
    """The allowance of the capture under way in this thread, or one bounded by free memory
    alone (``torch.compile(backend="autoopt")`` outside ``optimize``)."""
    current = getattr(_local, "allowance", None)
    return current if current is not None else Allowance(torch.device("cpu"))


@contextlib.contextmanager
def allowing(limit: int | float | None, device: torch.device) -> Iterator[Allowance]:
    """Bound what the steps inside the block may add (``optimize_memory``): ``limit`` in bytes,
    a fraction of the memory free on entry, or None for whatever is free."""
    if isinstance(limit, float):
        limit = int(limit * (free_bytes(device) or 0)) or None
    previous = getattr(_local, "allowance", None)
    _local.allowance = current = Allowance(device, limit, _in_use(device))
    try:
        yield current
    finally:
        _local.allowance = previous
