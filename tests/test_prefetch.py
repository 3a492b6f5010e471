"""``autoopt.data.prefetch``: order, completeness, early stop, loader failure, devices."""

from __future__ import annotations

import multiprocessing
import threading
import time
from collections.abc import Callable, Iterator

import pytest
import torch
from torch.utils.data import DataLoader, Dataset, TensorDataset

from autoopt.errors import ConfigError, DeviceError
from autoopt.runtime.prefetch import prefetch


class _Numbered(Dataset):
    """Item i is (a tensor filled with i, i, {"id": i}); optionally slow or failing at one."""

    def __init__(self, n: int, delay_s: float = 0.0, fail_at: int | None = None) -> None:
        self.n, self.delay_s, self.fail_at = n, delay_s, fail_at

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int, dict[str, int]]:
        if i == self.fail_at:
            raise RuntimeError(f"item {i} is corrupt")
        time.sleep(self.delay_s)
        return torch.full((3,), float(i)), i, {"id": i}


def test_order_and_completeness_match_the_loader() -> None:
    loader = DataLoader(_Numbered(23), batch_size=4)
    expected = list(loader)
    it = iter(prefetch(loader, "cpu", depth=3))
    got = list(it)
    assert len(got) == len(expected) == 6
    for (x, y, meta), (ex, ey, emeta) in zip(got, expected, strict=True):
        torch.testing.assert_close(x, ex)
        assert y.tolist() == ey.tolist()
        assert meta["id"].tolist() == emeta["id"].tolist()
    ids = [i for _, y, _ in got for i in y.tolist()]
    assert ids == list(range(23))  # none lost, none repeated, in order
    assert not it.thread.is_alive()


def test_each_iteration_is_a_new_pass() -> None:
    batches = prefetch(DataLoader(TensorDataset(torch.arange(10.0)), batch_size=5), depth=1)
    first = [b[0].tolist() for b in batches]
    second = [b[0].tolist() for b in batches]
    assert first == second == [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]]
    assert len(batches) == 2


@pytest.mark.parametrize("depth", [1, 4])
def test_early_stop_ends_the_thread(depth: int) -> None:
    loader = DataLoader(_Numbered(1000, delay_s=0.001), batch_size=2)
    it = iter(prefetch(loader, "cpu", depth=depth))
    seen = [next(it)[1].tolist() for _ in range(3)]
    assert seen == [[0, 1], [2, 3], [4, 5]]
    start = time.perf_counter()
    it.close()
    assert time.perf_counter() - start < 5.0
    assert not it.thread.is_alive()
    with pytest.raises(StopIteration):
        next(it)


def test_break_out_of_a_for_loop_with_the_context_manager() -> None:
    loader = DataLoader(_Numbered(1000, delay_s=0.001), batch_size=2)
    with iter(prefetch(loader, depth=2)) as it:
        for i, _ in enumerate(it):
            if i == 2:
                break
    assert not it.thread.is_alive()


def test_closing_the_prefetcher_stops_its_passes() -> None:
    batches = prefetch(DataLoader(_Numbered(1000, delay_s=0.001), batch_size=2), depth=2)
    it = iter(batches)
    next(it)
    batches.close()
    assert it.closed and not it.thread.is_alive()


def test_loader_error_is_raised_in_the_consumer_after_the_good_batches() -> None:
    loader = DataLoader(_Numbered(20, fail_at=9), batch_size=4)
    got = []
    it = iter(prefetch(loader, "cpu", depth=2))
    with pytest.raises(RuntimeError, match="item 9 is corrupt"):
        for _, y, _ in it:
            got.extend(y.tolist())
    assert got == list(range(8))  # the two batches before the failing one, in order
    assert not it.thread.is_alive()


def test_a_generator_source_is_closed_when_the_consumer_stops() -> None:
    finished = threading.Event()

    def source():
        try:
            for i in range(10_000):
                yield torch.tensor([i])
        finally:
            finished.set()

    class Loader:
        def __iter__(self):
            return source()

    it = iter(prefetch(Loader(), depth=2))
    assert next(it).item() == 0
    it.close()
    assert finished.wait(5.0)


def _new_threads(before: set[threading.Thread], wait_s: float = 5.0) -> list[threading.Thread]:
    """Prefetch threads started since ``before`` that are still alive after ``wait_s``."""
    deadline = time.monotonic() + wait_s
    while True:
        alive = [t for t in threading.enumerate()
                 if t.name == "autoopt-prefetch" and t not in before]
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.02)


def _children(wait_s: float = 5.0) -> list[multiprocessing.process.BaseProcess]:
    """Child processes (DataLoader workers) still alive after ``wait_s``."""
    deadline = time.monotonic() + wait_s
    while multiprocessing.active_children() and time.monotonic() < deadline:
        time.sleep(0.02)
    return multiprocessing.active_children()


def test_break_out_of_a_plain_for_loop_ends_the_thread_workers_and_generator() -> None:
    """No ``with``, no ``close()``: the loop drops the iterator, and that must end the pass
    (before, each epoch left its thread and its two worker processes alive for good)."""
    before = set(threading.enumerate())
    assert not _children(0.0)
    batches = prefetch(DataLoader(_Numbered(400), batch_size=2, num_workers=2), depth=2)
    for _ in range(3):
        for i, _ in enumerate(batches):
            if i == 2:
                break
    assert _new_threads(before) == []
    assert _children() == []

    finished = threading.Event()

    def source() -> Iterator[torch.Tensor]:
        try:
            yield from (torch.tensor([i]) for i in range(10_000))
        finally:
            finished.set()

    for i, _ in enumerate(prefetch(_Iterable(source), depth=2)):
        if i == 1:
            break
    assert finished.wait(5.0)  # the generator's finally ran
    assert _new_threads(before) == []


def test_persistent_workers_are_left_to_the_loader_across_passes() -> None:
    """The loader hands every pass the same iterator; a pass left by a break may still be
    inside its next() when the following pass starts, and must finish first: two threads
    reading one iterator would steal each other's batches."""
    loader = DataLoader(_Numbered(40, delay_s=0.005), batch_size=4, num_workers=1,
                        persistent_workers=True)
    batches = prefetch(loader, depth=2)
    for _ in range(3):
        for i, (_, y, _) in enumerate(batches):
            assert y.tolist() == list(range(4 * i, 4 * i + 4))
            if i == 1:
                break
    assert len(_children(0.5)) == 1  # the loader's own worker, kept for its next pass
    del batches, loader
    assert _children() == []


def test_an_exception_in_the_loop_body_ends_the_pass() -> None:
    before = set(threading.enumerate())
    with pytest.raises(ValueError, match="training step failed"):
        for _ in prefetch(DataLoader(_Numbered(1000, delay_s=0.001), batch_size=2), depth=2):
            raise ValueError("training step failed")
    assert _new_threads(before) == []


def test_a_loader_error_shuts_down_its_workers() -> None:
    """The error's traceback holds the DataLoader iterator (the consumer keeps it), so the
    workers are shut down explicitly rather than when that iterator is collected."""
    loader = DataLoader(_Numbered(20, fail_at=9), batch_size=4, num_workers=2)
    with pytest.raises(RuntimeError, match="item 9 is corrupt") as caught:
        list(prefetch(loader, depth=2))
    assert caught.value is not None  # the traceback is still held here
    assert _children() == []


def test_close_from_another_thread_wakes_the_waiting_consumer() -> None:
    """The consumer waits for a batch the loader is slow to make; a close() from another
    thread (a watchdog, a signal handler's helper) must end that wait at once."""
    release, finished = threading.Event(), threading.Event()

    def stuck() -> Iterator[torch.Tensor]:
        try:
            yield torch.tensor([0])
            release.wait(30.0)  # a loader stuck in I/O
            yield torch.tensor([1])
        finally:
            finished.set()

    it = iter(prefetch(_Iterable(stuck), depth=1))
    assert next(it).item() == 0
    outcome: list[str] = []

    def consume() -> None:
        try:
            next(it)
            outcome.append("batch")
        except StopIteration:
            outcome.append("stopped")

    consumer = threading.Thread(target=consume, daemon=True)
    consumer.start()
    time.sleep(0.2)  # the consumer is waiting now
    closer = threading.Thread(target=it.close, daemon=True)  # waits for the stuck producer
    closer.start()
    consumer.join(5.0)
    assert not consumer.is_alive() and outcome == ["stopped"]
    release.set()  # the loader's call returns; the producer sees the close and ends it
    closer.join(5.0)
    assert not closer.is_alive() and not it.thread.is_alive() and finished.is_set()


class _Iterable:
    """A loader whose passes are ``make()``'s generators."""

    def __init__(self, make: Callable[[], Iterator[torch.Tensor]]) -> None:
        self.make = make

    def __iter__(self) -> Iterator[torch.Tensor]:
        return self.make()


def test_bad_arguments_name_what_to_do() -> None:
    with pytest.raises(ConfigError, match="depth must be an integer >= 1; got 0"):
        prefetch([], depth=0)
    with pytest.raises(ConfigError, match="needs an iterable of batches"):
        prefetch(3)  # type: ignore[arg-type]
    with pytest.raises(DeviceError, match="is not a device name"):
        prefetch([], device="gpu0")
    if not torch.cuda.is_available():
        with pytest.raises(DeviceError, match="no CUDA GPU is available; use device='cpu'"):
            prefetch([], device="cuda")


@pytest.mark.gpu
def test_cuda_batches_arrive_on_the_device_in_order() -> None:
    loader = DataLoader(_Numbered(64), batch_size=8)
    expected = list(loader)
    got = list(prefetch(loader, "cuda", depth=3))
    assert len(got) == len(expected)
    for (x, y, _), (ex, ey, _) in zip(got, expected, strict=True):
        assert x.is_cuda and y.is_cuda
        # Read on the consumer's stream right away: the copy must have finished before it.
        torch.testing.assert_close(x.cpu(), ex)
        assert y.cpu().tolist() == ey.tolist()
