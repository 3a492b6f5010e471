"""Silence what a dependency prints on stderr because autoopt called it, and only that.

``torch.profiler`` (Kineto, C++) writes ``USDT: ... profiler_start`` and ``profiler_stop`` on
every profiled run, and on a machine with the CUDA build of torch but no GPU ``ERROR: ...
gpuGetDeviceCount failed with code 35``: four lines of noise in every ``autoopt diagnose``.
They bypass Python (``std::cerr``), so ``quiet_kineto`` points file descriptor 2 at a
temporary file for the profiled steps and writes back every line but those.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import tempfile
from collections.abc import Iterator

# Kineto's log format: LEVEL:yyyy-mm-dd hh:mm:ss pid:tid File.cpp:line] message
_KINETO = re.compile(rb"^(?P<level>[A-Z]+):\d{4}-\d\d-\d\d \d\d:\d\d:\d\d \d+:\d+ \S+\.cpp:\d+\] "
                     rb"(?P<message>.*)$")


def is_noise(line: bytes, gpu: bool) -> bool:
    """A Kineto trace marker (``USDT``), or the device count a GPU-less machine fails to read
    (``gpu``: the profiled run asked for a GPU, where that failure is news)."""
    match = _KINETO.match(line.rstrip(b"\r\n"))
    if match is None:
        return False
    return match["level"] == b"USDT" or (not gpu and b"gpuGetDeviceCount failed"
                                         in match["message"])


@contextlib.contextmanager
def quiet_kineto(gpu: bool) -> Iterator[None]:
    """Drop Kineto's noise (``is_noise``) from stderr while the block runs; everything else
    written there meanwhile is written back when it ends."""
    try:
        fd = sys.__stderr__.fileno() if sys.__stderr__ is not None else 2
        saved = os.dup(fd)
    except (AttributeError, OSError, ValueError):  # no real stderr (an embedded interpreter)
        yield
        return
    with tempfile.TemporaryFile() as held:
        for stream in (sys.stderr, sys.__stderr__):
            _flush(stream)
        os.dup2(held.fileno(), fd)
        try:
            yield
        finally:
            for stream in (sys.stderr, sys.__stderr__):
                _flush(stream)
            os.dup2(saved, fd)
            os.close(saved)
            held.seek(0)
            kept = b"".join(line for line in held if not is_noise(line, gpu))
            if kept:
                os.write(fd, kept)


def _flush(stream: object) -> None:
    with contextlib.suppress(Exception):
        stream.flush()  # type: ignore[attr-defined]
