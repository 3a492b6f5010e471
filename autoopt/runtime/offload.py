"""Offload saved activations to host memory during forward; bring them back for backward.

``Offloader.hooks(i)`` is a ``saved_tensors_hooks`` context for segment ``i``. Each tensor an
op saves is copied, whole storage at once (views of one storage share one copy), into a host
buffer taken from a pool, so no host allocation happens per step once the pool is warm. On a
GPU the buffers are pinned, the copies run on a side stream, and when backward first needs a
tensor of segment ``i`` the whole segment comes back and segment ``i-1`` (the next one backward
needs, when it is offloaded) starts coming back too, overlapping the backward of ``i``. On a
CPU the same code runs with the host as both ends: copies are synchronous and unpack returns a
fresh copy.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

log = logging.getLogger(__name__)


@dataclass
class OffloadStats:
    """What the offloader did since it was made (for the report and tests).

    Args:
        copies_out: storages copied to host.
        bytes_out: bytes copied to host.
        copies_in: storages brought back.
        host_allocations: host buffers allocated (a warm pool allocates none per step).
    """

    copies_out: int = 0
    bytes_out: int = 0
    copies_in: int = 0
    host_allocations: int = 0


class HostPool:
    """Host buffers (pinned on a GPU machine) reused across steps, by exact size.

    A buffer is handed out again only after the copy that last wrote it finished (its event).
    """

    def __init__(self, pin: bool, stats: OffloadStats) -> None:
        self._pin = pin
        self._stats = stats
        self._free: dict[int, list[tuple[torch.Tensor, list[Any]]]] = {}
        self._lock = threading.Lock()  # backward may run on autograd's device threads

    def take(self, nbytes: int) -> torch.Tensor:
        with self._lock:
            free = self._free.get(nbytes)
            if free:
                buffer, events = free.pop()
                for event in events:  # the copies that read or wrote it have finished
                    event.synchronize()
                return buffer
            self._stats.host_allocations += 1
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=self._pin)

    def give(self, buffer: torch.Tensor, events: list[Any]) -> None:
        with self._lock:
            self._free.setdefault(buffer.numel(), []).append((buffer, list(events)))

    @property
    def held_bytes(self) -> int:
        return sum(b.numel() for free in self._free.values() for b, _ in free)


class _HostCopy:
    """One device storage's copy in a pooled host buffer, and its way back."""

    __slots__ = ("host", "event", "restored", "ready", "events", "__weakref__")

    def __init__(self, host: torch.Tensor, event: Any) -> None:
        self.host = host
        self.event = event  # copy out finished (GPU), None on the host
        self.restored: torch.Tensor | None = None  # the bytes back on the device
        self.ready: Any = None  # copy back finished (GPU)
        # Every copy touching ``host``: the pool waits for them before handing it out again.
        self.events: list[Any] = [event] if event is not None else []


@dataclass(frozen=True)
class _Packed:
    copy: _HostCopy
    segment: int
    dtype: torch.dtype
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int


class Offloader:
    """Saved-tensor hooks that move a segment's saved activations to host memory and back.

    Args:
        device: where the model runs.
        keep: storages (data pointers) never to offload: parameters and buffers, which stay on
            the device anyway.
    """

    def __init__(self, device: torch.device, keep: set[int] | None = None) -> None:
        device = torch.device(device)
        cuda = device.type == "cuda"
        if cuda and device.index is None:  # tensors say cuda:N; compare like with like
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        self.keep = keep or set()
        self.stats = OffloadStats()
        self.pool = HostPool(pin=cuda, stats=self.stats)
        self._stream = torch.cuda.Stream(device) if cuda else None
        # Per segment, this step's host copies (weakly: the autograd graph owns them).
        self._segments: dict[int, list[weakref.ref[_HostCopy]]] = {}

    @contextlib.contextmanager
    def hooks(self, segment: int) -> Iterator[None]:
        """Offload what ops save inside this context, as part of ``segment``."""
        # Until the segment ends its storages are held (so a pointer cannot be reused and
        # mistaken for an already copied storage); after that only the host copy remains.
        copies: dict[int, tuple[torch.Tensor, _HostCopy]] = {}
        self._segments[segment] = []

        def pack(t: torch.Tensor) -> Any:
            return self._pack(t, segment, copies)

        try:
            with torch.autograd.graph.saved_tensors_hooks(pack, self._unpack):
                yield
        finally:
            copies.clear()

    def _pack(self, t: torch.Tensor, segment: int,
              copies: dict[int, tuple[torch.Tensor, _HostCopy]]) -> Any:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if (t.device != self.device or ptr in self.keep or not storage.nbytes()
                or t.layout != torch.strided):
            return t
        if ptr not in copies:
            copies[ptr] = (t, self._copy_out(t, storage))
            self._segments[segment].append(weakref.ref(copies[ptr][1]))
        return _Packed(copies[ptr][1], segment, t.dtype, tuple(t.size()), tuple(t.stride()),
                       t.storage_offset())

    def _copy_out(self, t: torch.Tensor, storage: torch.UntypedStorage) -> _HostCopy:
        nbytes = storage.nbytes()
        host = self.pool.take(nbytes)
        source = torch.empty(0, dtype=torch.uint8, device=self.device).set_(storage)
        event = None
        if self._stream is not None:
            self._stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self._stream):
                host.copy_(source, non_blocking=True)
                event = torch.cuda.Event()
                event.record(self._stream)
            # The caching allocator must not reuse the activation before the copy read it.
            t.record_stream(self._stream)
        else:
            host.copy_(source)
        self.stats.copies_out += 1
        self.stats.bytes_out += nbytes
        copy = _HostCopy(host, event)
        # When autograd frees the saved tensor, the host buffer goes back to the pool.
        weakref.finalize(copy, self.pool.give, host, copy.events)
        return copy

    def _unpack(self, packed: Any) -> torch.Tensor:
        if not isinstance(packed, _Packed):
            return packed
        if packed.copy.restored is None:
            self._bring_back(packed.segment)
            # Prefetch the segment backward reaches next, if it is offloaded (only that one:
            # the plan counts its bytes as alive during this segment's backward).
            self._bring_back(packed.segment - 1)
        copy = packed.copy
        if copy.restored is None:  # not registered: a segment run again (double backward)
            self._copy_in(copy)
        assert copy.restored is not None
        if copy.ready is not None:
            current = torch.cuda.current_stream(self.device)
            current.wait_event(copy.ready)
            copy.restored.record_stream(current)
        return torch.empty(0, dtype=packed.dtype, device=self.device).set_(
            copy.restored.untyped_storage(), packed.offset, packed.size, packed.stride)

    def _bring_back(self, segment: int) -> None:
        for ref in self._segments.pop(segment, []):
            copy = ref()
            if copy is not None and copy.restored is None:
                self._copy_in(copy)

    def _copy_in(self, copy: _HostCopy) -> None:
        if self._stream is None:
            copy.restored = copy.host.clone()
        else:
            with torch.cuda.stream(self._stream):
                if copy.event is not None:
                    self._stream.wait_event(copy.event)
                copy.restored = torch.empty(copy.host.numel(), dtype=torch.uint8,
                                            device=self.device)
                copy.restored.copy_(copy.host, non_blocking=True)
                copy.ready = torch.cuda.Event()
                copy.ready.record(self._stream)
                copy.events.append(copy.ready)
        self.stats.copies_in += 1


class Offload(nn.Module):
    """Runs ``segment`` with its saved activations offloaded by ``offloader``."""

    def __init__(self, segment: nn.Module, offloader: Offloader, index: int) -> None:
        super().__init__()
        self.segment = segment
        self.offloader = offloader
        self.index = index

    def forward(self, *args: Any) -> Any:
        with self.offloader.hooks(self.index):
            return self.segment(*args)


def saved_bytes_counter(keep: set[int]) -> SavedBytes:
    """A context counting the bytes of distinct storages saved for backward on the device,
    outside ``keep`` (parameters). Hooks entered inside it (offload, checkpoint) take over
    what they save: that memory is not held on the device."""
    return SavedBytes(keep)


class SavedBytes(torch.autograd.graph.saved_tensors_hooks):
    """See ``saved_bytes_counter``; ``.bytes`` is the total after the context."""

    def __init__(self, keep: set[int]) -> None:
        self.bytes = 0
        seen: set[int] = set()
        self._held: list[torch.Tensor] = []  # keeps pointers unique while counting
        held = self._held

        def pack(t: torch.Tensor) -> torch.Tensor:
            storage = t.untyped_storage()
            ptr = storage.data_ptr()
            if ptr not in keep and ptr not in seen:
                seen.add(ptr)
                held.append(t)
                self.bytes += storage.nbytes()
            return t

        super().__init__(pack, lambda t: t)

    def __enter__(self) -> SavedBytes:
        super().__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        super().__exit__(*exc)
        self._held.clear()
