"""Captures exclude calls in other threads; calls run side by side.

``torch.export`` and Dynamo change process-wide state while they trace (a fake tensor mode,
patched functions, a shape environment): a graph replayed in another thread at that moment
fails with errors such as "fake_mode.in_kernel_invocation must be False", or leaves the
process with placeholder sizes. So a capture waits for running calls to finish and holds new
ones back until it is done; calls never wait for each other. A thread already inside a call
or a capture (an optimized module nested in another) passes straight through.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator


class CaptureGate:
    """A readers-writer lock: calls read, captures write."""

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._readers = 0
        self._writer: int | None = None  # the capturing thread's ident
        self._local = threading.local()

    def _depth(self) -> int:
        return getattr(self._local, "depth", 0)

    @contextlib.contextmanager
    def calling(self) -> Iterator[None]:
        if self._depth():  # nested in this thread's own call or capture
            yield
            return
        with self._cond:
            while self._writer is not None:
                self._cond.wait()
            self._readers += 1
        self._local.depth = 1
        try:
            yield
        finally:
            self._local.depth = 0
            with self._cond:
                self._readers -= 1
                if not self._readers:
                    self._cond.notify_all()

    def wait_for_captures(self) -> None:
        """Return once no other thread is capturing: its tracing swaps other tensors into the
        modules' slots for a moment, which a call checking the slots must not take for the
        user's own swap."""
        me = threading.get_ident()
        if self._writer is None or self._writer == me:  # the common call: no lock taken
            return
        with self._cond:
            while self._writer is not None and self._writer != me:
                self._cond.wait()

    @contextlib.contextmanager
    def capturing(self) -> Iterator[None]:
        me = threading.get_ident()
        if self._writer == me:  # a capture inside this thread's own capture
            yield
            return
        # From inside a call of this thread (an optimized module nested in another), waiting
        # for the other calls could wait on one that waits for this thread: only other
        # captures are excluded then.
        nested = bool(self._depth())
        with self._cond:
            while self._writer is not None or (self._readers and not nested):
                self._cond.wait()
            self._writer = me
        depth = self._depth()
        self._local.depth = depth + 1
        try:
            yield
        finally:
            self._local.depth = depth
            with self._cond:
                self._writer = None
                self._cond.notify_all()


GATE = CaptureGate()  # one per process: tracing state is process-wide
