"""Asynchronous data loading: the next batches are read and copied while the model computes.

    for x, y in autoopt.data.prefetch(loader, "cuda", depth=2):
        loss = model(x).sum()          # x is already on the GPU; batch i+1, i+2 are on the way

A background thread pulls batches from ``loader``. On CUDA it pins each batch's tensors and
copies them to the device with ``non_blocking=True`` on a side stream, so the copy overlaps the
compute on the main stream; the consumer's stream waits on the copy's event before it touches a
batch. On the CPU the batches pass through unchanged (the thread still overlaps the loader's
own work with the model's). Order is kept, no batch is lost or repeated, a loader's exception is
re-raised in the consumer, and stopping early (``break``, ``close()`` from any thread, garbage
collection, an exception) ends the thread and the loader's worker processes.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import weakref
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils import _pytree as pytree

from autoopt.errors import ConfigError, DeviceError

log = logging.getLogger(__name__)

# How often a blocked producer re-checks whether the consumer has gone.
_POLL_S = 0.05


@dataclass(frozen=True)
class _Ready:
    """A batch on its way to the consumer, with the event its copy recorded (CUDA only)."""

    batch: Any
    event: torch.cuda.Event | None


@dataclass(frozen=True)
class _Failed:
    """The loader raised; the consumer re-raises ``error``."""

    error: BaseException


_END = object()


def prefetch(loader: Iterable[Any], device: str | torch.device = "cpu",
             depth: int = 2) -> Prefetcher:
    """Iterate over ``loader`` with up to ``depth`` batches loaded (and copied) ahead.

    Args:
        loader: any iterable of batches (a ``DataLoader``); batches may be tensors or nested
            tuples, lists and dicts of them. Each ``iter()`` of the result starts one pass.
        device: where the batches should end up; on ``cuda`` copies are asynchronous.
        depth: batches held ready ahead of the consumer (at least 1).

    Returns:
        An iterable whose iterators can be closed early (``close()`` or ``with``).

    Example:
        >>> for x, y in autoopt.data.prefetch(loader, "cuda"):
        ...     train_step(x, y)
    """
    if not isinstance(depth, int) or isinstance(depth, bool) or depth < 1:
        raise ConfigError(f"prefetch depth must be an integer >= 1; got {depth!r}")
    if not isinstance(loader, Iterable):
        raise ConfigError(f"prefetch needs an iterable of batches (a DataLoader); got "
                          f"{type(loader).__name__}")
    try:
        target = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise DeviceError(f"prefetch device={device!r} is not a device name; use 'cpu', 'cuda' "
                          f"or 'cuda:N'.") from exc
    if target.type == "cuda" and not torch.cuda.is_available():
        raise DeviceError(f"prefetch device={device!r} asks for CUDA but no CUDA GPU is "
                          f"available; use device='cpu'.")
    return Prefetcher(loader, target, depth)


class Prefetcher:
    """What ``prefetch`` returns: iterable once per ``iter()``, like the loader it wraps."""

    def __init__(self, loader: Iterable[Any], device: torch.device, depth: int) -> None:
        self.loader = loader
        self.device = device
        self.depth = depth
        # Weak: a pass the consumer has dropped (a break) must be free to be collected.
        self._active: weakref.WeakSet[PrefetchIterator] = weakref.WeakSet()
        self._threads: list[tuple[threading.Thread, threading.Event]] = []  # (producer, stop)

    def __iter__(self) -> PrefetchIterator:
        # A pass stopped by a break may still be inside the loader's next(). A DataLoader with
        # persistent workers gives the new pass that same iterator, which two threads must not
        # read at once: the stopped pass finishes first.
        for thread, stop in self._threads:
            if stop.is_set():
                thread.join(timeout=10.0)
        self._threads = [(t, stop) for t, stop in self._threads if t.is_alive()]
        it = PrefetchIterator(iter(self.loader), self.device, self.depth)
        self._active.add(it)
        self._threads.append((it.thread, it._stop))
        return it

    def __len__(self) -> int:
        return len(self.loader)  # type: ignore[arg-type]

    def close(self) -> None:
        """Stop every pass still running."""
        for it in list(self._active):
            it.close()
        self._active.clear()


class PrefetchIterator:
    """One pass over the loader, fed by a background thread ``depth`` batches ahead.

    The pass ends (the thread stops, a ``DataLoader``'s workers are shut down, a generator's
    ``finally`` runs) when the loader is exhausted or raises, on ``close()`` from any thread,
    at the end of a ``with`` block, and when the iterator is garbage collected, which is what
    a ``break`` out of ``for batch in prefetch(...)`` does. The consumer never waits on the
    thread without waking up to see whether the pass was closed.
    """

    def __init__(self, source: Iterator[Any], device: torch.device, depth: int) -> None:
        self.device = device
        self.wait_s = 0.0  # seconds the consumer spent waiting for a batch not yet ready
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        # The thread gets what it needs but never this object: a thread holding it would keep
        # it alive, so dropping the iterator (a break) could never stop the thread. The source
        # goes in a box the thread empties when it ends, so no frame keeps it alive after.
        self._thread = threading.Thread(
            target=_produce, args=([source], self._queue, self._stop, stream, device),
            name="autoopt-prefetch", daemon=True)
        self._thread.start()
        self._finalizer = weakref.finalize(self, _stop_producer, self._stop, self._queue)

    @property
    def thread(self) -> threading.Thread:
        return self._thread

    @property
    def closed(self) -> bool:
        return self._stop.is_set()

    def __iter__(self) -> PrefetchIterator:
        return self

    def __next__(self) -> Any:
        start = time.perf_counter()
        try:
            item = self._get()
        finally:
            self.wait_s += time.perf_counter() - start
        if item is _END:
            self.close()
            raise StopIteration
        if isinstance(item, _Failed):
            self.close()
            raise item.error
        if item.event is not None:
            # The consumer's stream must not read the batch before the side-stream copy ends,
            # and the allocator must not reuse its memory while the consumer's stream uses it.
            current = torch.cuda.current_stream(self.device)
            current.wait_event(item.event)
            for t in pytree.tree_leaves(item.batch):
                if isinstance(t, torch.Tensor) and t.is_cuda:
                    t.record_stream(current)
        return item.batch

    def _get(self) -> Any:
        """The next item, waiting in short slices so a ``close()`` from another thread (which
        sends nothing) ends the wait."""
        while True:
            if self._stop.is_set():
                raise StopIteration
            try:
                return self._queue.get(timeout=_POLL_S)
            except queue.Empty:
                # The producer always leaves an end marker or an error unless stopped; this
                # only guards against a thread that died some other way.
                if not self._thread.is_alive() and self._queue.empty():
                    self.close()
                    raise StopIteration from None

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop the background thread (from any thread) and drop the batches it had ready."""
        self._finalizer()  # runs once: later calls, and garbage collection, only join
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=timeout_s)
            if self._thread.is_alive():  # the loader itself is stuck inside next()
                log.warning("prefetch thread still inside the loader's next() after %.0f s; "
                            "it ends when that call returns", timeout_s)
        _drain(self._queue)

    def __enter__(self) -> PrefetchIterator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# --- the producer thread (module functions: the thread must not hold the iterator) -----------


def _stop_producer(stop: threading.Event, out: queue.Queue[Any]) -> None:
    """Tell the producer to end, and free the batches it had ready. Never waits: it also runs
    at garbage collection, possibly on the producer thread itself."""
    stop.set()
    _drain(out)


def _produce(box: list[Iterator[Any]], out: queue.Queue[Any], stop: threading.Event,
             stream: torch.cuda.Stream | None, device: torch.device) -> None:
    source = box.pop()
    try:
        while not stop.is_set():
            try:
                batch = next(source)
            except StopIteration:
                _put(out, stop, _END)
                return
            if not _put(out, stop, _to_device(batch, stream, device)):
                return
    except BaseException as exc:  # noqa: BLE001 - handed to the consumer, re-raised there
        _put(out, stop, _Failed(exc))
    finally:
        _end_source(source)
        # The error handed over keeps this frame alive through its traceback.
        del source


def _end_source(source: Iterator[Any]) -> None:
    """End what the source holds: a generator's ``finally`` blocks run now, and a
    ``DataLoader``'s worker processes exit (its iterator would only shut them down when
    garbage collected, which an error's traceback, holding its frames, can put off
    indefinitely). Persistent workers are the loader's to keep across passes."""
    close = getattr(source, "close", None)
    shutdown = (None if getattr(source, "_persistent_workers", False)
                else getattr(source, "_shutdown_workers", None))
    for end in (close, shutdown):
        if callable(end):
            try:
                end()
            except Exception:  # noqa: BLE001 - ending a finished source is best effort
                log.debug("prefetch: ending the loader's iterator failed", exc_info=True)


def _put(out: queue.Queue[Any], stop: threading.Event, item: Any) -> bool:
    """Hand ``item`` over, waiting for room; False once the consumer has stopped."""
    while not stop.is_set():
        try:
            out.put(item, timeout=_POLL_S)
            return True
        except queue.Full:
            continue
    return False


def _to_device(batch: Any, stream: torch.cuda.Stream | None, device: torch.device) -> _Ready:
    if stream is None:
        return _Ready(batch, None)
    with torch.cuda.stream(stream):
        moved = pytree.tree_map_only(torch.Tensor, lambda t: _copy(t, device), batch)
        event = torch.cuda.Event()
        event.record(stream)
    return _Ready(moved, event)


def _copy(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    if t.device == device:
        return t
    if t.device.type == "cpu" and not t.is_pinned():
        t = t.pin_memory()  # only pinned host memory can be copied asynchronously
    return t.to(device, non_blocking=True)


def _drain(out: queue.Queue[Any]) -> None:
    while True:
        try:
            out.get_nowait()
        except queue.Empty:
            return
