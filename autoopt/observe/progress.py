"""Progress of a long library call (``optimize``, ``export_onnx``, ``diagnose``, a first
``generate``) on stderr, for a user who has not configured logging for autoopt.

autoopt logs what it is doing (each capture method, pass, measurement, verification) under
the ``autoopt`` logger, which the command line shows as a status line. Called from Python with
logging left as it is, those records go nowhere, and optimizing a large model was a silent
terminal for a minute. ``reported`` takes them for the length of the call: once the call has
run ``FIRST_S`` seconds, a line says what it is doing, and another follows at least every
``EVERY_S`` seconds while it runs (lines, not a redrawn one: notebooks and log files show them
too); a call that ends sooner prints nothing. Warnings still reach the handlers they reached
before. Nothing is shown where the user gave the ``autoopt`` logger a handler of their own
(the command line does) or shows its INFO records already, or with ``AUTOOPT_PROGRESS=0``.
"""

from __future__ import annotations

import functools
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TextIO, TypeVar

F = TypeVar("F", bound=Callable[..., Any])

FIRST_S = 5.0
EVERY_S = 10.0
_LIBRARY = logging.getLogger("autoopt")
_lock = threading.Lock()
_active: _Progress | None = None  # the outermost call's, shared by nested and other threads
_depth = 0


@contextmanager
def reported(what: str) -> Iterator[None]:
    """Show the progress of ``what`` (``optimize``) on stderr while it runs, where nobody
    else shows autoopt's records."""
    global _active, _depth
    with _lock:
        if _active is None and not _wanted():
            started = None
        else:
            if _active is None:
                _active = _Progress(what, sys.stderr)
            _depth += 1
            started = _active
    if started is None:
        yield
        return
    finished = False
    try:
        yield
        finished = True
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0:
                _active = None
                started.close(finished)


def reporting(what: str) -> Callable[[F], F]:
    """``reported(what)`` around every call of the decorated function."""
    def decorate(fn: F) -> F:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            with reported(what):
                return fn(*args, **kwargs)

        return wrapper  # type: ignore[return-value]

    return decorate


def _wanted() -> bool:
    if os.environ.get("AUTOOPT_PROGRESS", "1").strip() in ("0", "false", "no", "off"):
        return False
    if _LIBRARY.handlers:  # the command line's, or the user's own
        return False
    if _LIBRARY.getEffectiveLevel() <= logging.INFO:  # INFO records reach a handler already
        logger: logging.Logger | None = _LIBRARY.parent
        while logger is not None:
            if logger.handlers:
                return False
            logger = logger.parent if logger.propagate else None
    return True


class Ticker(logging.Handler):
    """Keeps the latest INFO record's first line and, from another thread, writes
    ``autoopt WHAT: 12 s: <that line>`` on ``stream`` once the work has run ``FIRST_S``
    seconds, then whenever the record changed and ``FIRST_S`` passed, or ``EVERY_S`` did;
    ``done in N s`` at the end where it wrote any and the work finished (a failure's error
    follows instead: nothing was done). Nothing for work that ends sooner.

    The command line attaches one when stderr is piped (a CI log, ``| tee``), where no
    status line can be drawn; ``reported`` attaches ``_Progress``, one that takes the
    ``autoopt`` logger for a library call."""

    def __init__(self, what: str, stream: TextIO) -> None:
        super().__init__(logging.INFO)
        self.what = what
        self.stream = stream
        self.start = time.perf_counter()
        self.latest = "starting"
        self.shown = ""  # the record the last line showed
        self.last_line = 0.0  # seconds since the start at the last line; 0: none yet
        self.lines = 0
        self.stopped = threading.Event()
        self.ticker = threading.Thread(target=self._tick, name="autoopt-progress", daemon=True)
        self.ticker.start()

    def emit(self, record: logging.LogRecord) -> None:
        if record.levelno >= logging.WARNING:
            return  # shown by the handlers for warnings
        try:
            first = record.getMessage().split("\n", 1)[0]
        except Exception:  # noqa: BLE001 - a record that cannot be formatted is not shown
            return
        self.latest = first

    def close(self, finished: bool = True) -> None:
        """Stop the lines; ``finished``: the work completed (else it raised)."""
        self.stopped.set()
        self.ticker.join(timeout=1)
        if self.lines and finished:
            self._write(f"done in {time.perf_counter() - self.start:.1f} s")
        super().close()

    def _tick(self) -> None:
        while not self.stopped.wait(0.5):
            elapsed = time.perf_counter() - self.start
            if elapsed < FIRST_S:
                continue
            quiet = elapsed - self.last_line
            if self.lines == 0 or quiet >= EVERY_S or (self.latest != self.shown and quiet
                                                        >= FIRST_S):
                self.shown = self.latest
                self.last_line = elapsed
                self._write(f"{elapsed:.0f} s: {clip(self.latest, 160)}")

    def _write(self, text: str) -> None:
        try:
            self.stream.write(f"autoopt {self.what}: {text}\n")
            self.stream.flush()
            self.lines += 1
        except Exception:  # noqa: BLE001 - a closed stream: progress is not worth an error
            pass


class _Progress(Ticker):
    """A ``Ticker`` that takes the ``autoopt`` logger's records for the call (its level set
    to INFO, its propagation off) and hands each warning on to the handlers above as
    before."""

    def __init__(self, what: str, stream: TextIO) -> None:
        self.previous = (_LIBRARY.level, _LIBRARY.propagate)
        super().__init__(what, stream)
        _LIBRARY.addHandler(self)
        _LIBRARY.setLevel(logging.INFO)
        _LIBRARY.propagate = False

    def emit(self, record: logging.LogRecord) -> None:
        if record.levelno >= logging.WARNING:
            parent = _LIBRARY.parent
            if parent is not None and record.levelno >= parent.getEffectiveLevel():
                parent.handle(record)  # where it went before: the user's handlers, or stderr
            return
        super().emit(record)

    def close(self, finished: bool = True) -> None:
        _LIBRARY.removeHandler(self)
        _LIBRARY.setLevel(self.previous[0])
        _LIBRARY.propagate = self.previous[1]
        super().close(finished)


def clip(text: str, width: int) -> str:
    """``text`` cut to ``width`` characters, with ``...`` where it was cut."""
    return text if len(text) <= width else text[:max(width - 3, 0)] + "..."
