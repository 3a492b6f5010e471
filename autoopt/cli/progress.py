"""What a long command is doing, on stderr: a status line on a terminal, log lines with ``-v``,
warnings and a progress line every few seconds (``autoopt.observe.progress.Ticker``) when stderr is
piped.

Progress travels as ``logging`` records under the ``autoopt`` logger, so the CLI's own stages
(``stage()``, logged by ``autoopt.cli``) and whatever the library logs while it captures,
rewrites, measures and verifies reach the user the same way. The library itself never prints.
"""

from __future__ import annotations

import logging
import shutil
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TextIO

from autoopt.observe.progress import Ticker, clip

log = logging.getLogger("autoopt.cli")
_LIBRARY = logging.getLogger("autoopt")
_FORMAT = "%(levelname)s %(name)s: %(message)s"
_status: _StatusLine | None = None  # the status line drawn now, if any


def stage(text: str) -> None:
    """Announce the next step of a command (``loading the model``, ``optimizing``)."""
    log.info("%s", text)


def output(text: str = "") -> None:
    """Print a result on stdout, erasing the status line first: on a terminal both streams
    share one screen, and a result written after the status line would run into it."""
    if _status is None:
        print(text, flush=True)
    else:
        _status.print_above(text)


@contextmanager
def shown(command: str, verbose: bool, status_line: bool = True) -> Iterator[None]:
    """Show progress for the duration of one command.

    Args:
        command: the command's name, the status line's prefix.
        verbose: ``-v``: every INFO record as a line with the time since the start.
        status_line: on a terminal without ``-v``, one line redrawn in place. Commands that
            draw their own progress bars (``diagnose``, ``report``) pass False.
    """
    global _status
    stream = sys.stderr  # looked up now: tests and callers may have replaced it
    if verbose:
        handler: logging.Handler = _Lines(stream)
        level = logging.INFO
    elif status_line and _is_terminal(stream):
        handler = _status = _StatusLine(stream, command)
        level = logging.DEBUG  # passes log their measurements at DEBUG: they show as progress
    else:
        handler = logging.StreamHandler(stream)
        handler.setFormatter(logging.Formatter(_FORMAT))
        handler.setLevel(logging.WARNING)
        level = logging.WARNING
    # Piped (a CI log, | tee): no line can be redrawn, and a command of minutes was silent.
    # A line now and then, as pip and Hugging Face write; nothing for a command of seconds.
    # (On a terminal diagnose and report draw their own bars.)
    ticker = Ticker(command, stream) if not verbose and not _is_terminal(stream) else None
    handlers = [handler] + ([ticker] if ticker is not None else [])
    previous = _LIBRARY.level
    for each in handlers:
        _LIBRARY.addHandler(each)
    _LIBRARY.setLevel(logging.INFO if ticker is not None else level)
    finished = False
    try:
        yield
        finished = True
    finally:
        for each in handlers:
            _LIBRARY.removeHandler(each)
        _LIBRARY.setLevel(previous)
        for each in handlers:
            if isinstance(each, Ticker):
                each.close(finished)  # "done" only where the command finished
            else:
                each.close()
        _status = None


def _is_terminal(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # no isatty, or closed
        return False


def _source(name: str) -> str:
    """``autoopt.passes.merge_linear`` -> ``pass merge_linear``; ``autoopt.cost_model.model``
    -> ``measuring``; otherwise the module's first name under autoopt (``capture``, ``onnx``)."""
    parts = name.split(".")[1:] or ["autoopt"]
    if parts[0] == "passes" and len(parts) > 1:
        return f"pass {parts[1]}"
    if parts[0] == "cost_model":
        return "measuring"
    return parts[0]


def _measuring(name: str) -> bool:
    """A pass or the cost model: their DEBUG records are the measurements a status line
    shows as progress."""
    source = _source(name)
    return source.startswith("pass ") or source == "measuring"


class _Lines(logging.Handler):
    """``-v``: ``[  3.2s] capture: ...``, one line per record, whole messages."""

    def __init__(self, stream: TextIO) -> None:
        super().__init__(logging.INFO)
        self.stream = stream
        self.start = time.perf_counter()

    def emit(self, record: logging.LogRecord) -> None:
        try:
            message = record.getMessage()
            if record.name != log.name:
                message = f"{_source(record.name)}: {message}"
            if record.levelno >= logging.WARNING:
                message = f"{record.levelname.lower()}: {message}"
            elapsed = time.perf_counter() - self.start
            self.stream.write(f"[{elapsed:6.1f}s] {message}\n")
            self.stream.flush()
        except Exception:
            self.handleError(record)


class _StatusLine(logging.Handler):
    """A terminal line redrawn in place: elapsed time, the CLI's stage, the latest record's
    first line; a ticker keeps the clock moving through long silent steps. Warnings are
    printed in full above it; the line is erased at the end, leaving only the results."""

    _SPIN = "|/-\\"

    def __init__(self, stream: TextIO, command: str) -> None:
        super().__init__(logging.DEBUG)
        self.stream = stream
        self.command = command
        self.start = time.perf_counter()
        self.stage = "starting"
        self.detail = ""
        self.drawn = 0  # characters on the line now, to blank out on redraw
        self.ticks = 0
        self.write_lock = threading.Lock()
        self.stopped = threading.Event()
        self.ticker = threading.Thread(target=self._tick, name="autoopt-progress", daemon=True)
        self.ticker.start()

    def emit(self, record: logging.LogRecord) -> None:
        try:
            first = record.getMessage().split("\n", 1)[0]
            if record.levelno >= logging.WARNING:
                with self.write_lock:
                    self._erase()
                    self.stream.write(f"{record.levelname} {record.name}: "
                                      f"{record.getMessage()}\n")
                    self._draw()
                return
            if record.name == log.name:
                self.stage, self.detail = first, ""
            elif record.levelno >= logging.INFO or _measuring(record.name):
                self.detail = f"{_source(record.name)}: {first}"
            else:  # another module's DEBUG record: its internals (cache keys, file names)
                return
            with self.write_lock:
                self._draw()
        except Exception:
            self.handleError(record)

    def close(self) -> None:
        self.stopped.set()
        self.ticker.join(timeout=1)
        self.erase()
        super().close()

    def erase(self) -> None:
        with self.write_lock:
            self._erase()

    def print_above(self, text: str) -> None:
        """Print on stdout where the line was; the ticker draws it again below."""
        with self.write_lock:  # so that the ticker does not redraw in between
            self._erase()
            print(text, flush=True)

    def _tick(self) -> None:
        while not self.stopped.wait(0.25):
            with self.write_lock:
                self.ticks += 1
                self._draw()

    def _draw(self) -> None:
        width = shutil.get_terminal_size((80, 24)).columns - 1
        elapsed = time.perf_counter() - self.start
        text = (f"{self._SPIN[self.ticks % len(self._SPIN)]} autoopt {self.command} "
                f"{elapsed:5.1f}s  ")
        if self.detail:  # the stage gives up room first: the detail is what moves
            text += f"{clip(self.stage, max(16, (width - len(text)) // 3))} | {self.detail}"
        else:
            text += self.stage
        text = clip(text, width)
        self.stream.write("\r" + text.ljust(self.drawn))
        self.stream.flush()
        self.drawn = len(text)

    def _erase(self) -> None:
        if self.drawn:
            self.stream.write("\r" + " " * self.drawn + "\r")
            self.stream.flush()
            self.drawn = 0
