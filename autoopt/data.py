"""Asynchronous data loading: the next batches are read and copied while the model computes.

    for x, y in autoopt.data.prefetch(loader, "cuda", depth=2):
        loss = model(x).sum()          # x is already on the GPU; batch i+1, i+2 are on the way

A background thread pulls batches from ``loader``. On CUDA it pins each batch's tensors and
copies them to the device with ``non_blocking=True`` on a side stream, so the copy overlaps the
compute on the main stream; the consumer's stream waits on the copy's event before it touches a
batch. On the CPU the batches pass through unchanged (the thread still overlaps the loader's
own work with the model's). Order is kept, no batch is lost or repeated, a loader's exception is
re-raised in the consumer, and stopping early (``break``, ``close()``) ends the thread.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils import _pytree as pytree

from .errors import ConfigError, DeviceError

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
        self._active: list[PrefetchIterator] = []

    def __iter__(self) -> PrefetchIterator:
        self._active = [it for it in self._active if not it.closed]
        it = PrefetchIterator(iter(self.loader), self.device, self.depth)
        self._active.append(it)
        return it

    def __len__(self) -> int:
        return len(self.loader)  # type: ignore[arg-type]

    def close(self) -> None:
        """Stop every pass still running."""
        for it in self._active:
            it.close()
        self._active.clear()


class PrefetchIterator:
    """One pass over the loader, fed by a background thread ``depth`` batches ahead."""

    def __init__(self, source: Iterator[Any], device: torch.device, depth: int) -> None:
        self.device = device
        self.closed = False
        self.wait_s = 0.0  # seconds the consumer spent waiting for a batch not yet ready
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._thread = threading.Thread(target=self._produce, args=(source,),
                                         name="autoopt-prefetch", daemon=True)
        self._thread.start()

    @property
    def thread(self) -> threading.Thread:
        return self._thread

    def __iter__(self) -> PrefetchIterator:
        return self

    def __next__(self) -> Any:
        if self.closed:
            raise StopIteration
        start = time.perf_counter()
        item = self._queue.get()
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

    def close(self) -> None:
        """Stop the background thread and drop the batches it had ready."""
        if self.closed:
            return
        self.closed = True
        self._stop.set()
        self._drain()
        self._thread.join(timeout=10.0)
        if self._thread.is_alive():  # the loader itself is stuck inside next(); daemon thread
            log.warning("prefetch thread still inside the loader's next() after 10 s")
        self._drain()

    def __enter__(self) -> PrefetchIterator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        if not getattr(self, "closed", True):
            self.close()

    # --- the producer thread -------------------------------------------------------------

    def _produce(self, source: Iterator[Any]) -> None:
        try:
            for batch in source:
                if self._stop.is_set():
                    return
                if not self._put(self._to_device(batch)):
                    return
            self._put(_END)
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer, re-raised there
            self._put(_Failed(exc))
        finally:
            close = getattr(source, "close", None)  # a generator's finally blocks run now
            if callable(close):
                try:
                    close()
                except Exception:  # noqa: BLE001 - closing a finished source is best effort
                    pass

    def _put(self, item: Any) -> bool:
        """Hand ``item`` over, waiting for room; False once the consumer has stopped."""
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=_POLL_S)
                return True
            except queue.Full:
                continue
        return False

    def _to_device(self, batch: Any) -> _Ready:
        if self._stream is None:
            return _Ready(batch, None)
        with torch.cuda.stream(self._stream):
            moved = pytree.tree_map_only(torch.Tensor, self._copy, batch)
            event = torch.cuda.Event()
            event.record(self._stream)
        return _Ready(moved, event)

    def _copy(self, t: torch.Tensor) -> torch.Tensor:
        if t.device == self.device:
            return t
        if t.device.type == "cpu" and not t.is_pinned():
            t = t.pin_memory()  # only pinned host memory can be copied asynchronously
        return t.to(self.device, non_blocking=True)

    def _drain(self) -> None:
        while True:
            try:
                self._queue.get_nowait()
            except queue.Empty:
                return
