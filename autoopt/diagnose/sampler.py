"""How busy the hardware is while a workload runs, sampled on a background thread.

    with UtilizationSampler(interval_s=0.05) as sampler:
        run_workload()
    print(sampler.result.summary())

Each sample holds the CPU's utilization (whole machine, from ``/proc/stat``) and this
process's (its CPU time, all threads, as a share of the cores), and on an NVIDIA GPU,
through ``pynvml``: SM utilization, memory-controller (bandwidth) utilization, memory used and
PCIe throughput each way. Without a GPU, ``pynvml`` or a driver the result holds CPU figures
only and says so in ``note``.
"""

from __future__ import annotations

import logging
import os
import statistics
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from autoopt.cost_model.contention import proc_stat
from autoopt.errors import ConfigError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Sample:
    """One reading. GPU fields are None where there is no GPU to read.

    Args:
        t: seconds since the sampler started.
        cpu_percent: the whole machine's busy share of all cores, 0-100.
        process_cpu_percent: this process's CPU time over the interval as a share of all
            cores, 0-100.
        gpu_percent: share of the interval in which a kernel ran on the GPU (NVML), 0-100.
        gpu_memory_bandwidth_percent: share of the interval the memory controller was busy.
        gpu_memory_used: bytes of GPU memory in use (all processes).
        pcie_tx, pcie_rx: bytes/s the GPU sent to / received from the host.
    """

    t: float
    cpu_percent: float
    process_cpu_percent: float
    gpu_percent: float | None = None
    gpu_memory_bandwidth_percent: float | None = None
    gpu_memory_used: int | None = None
    pcie_tx: float | None = None
    pcie_rx: float | None = None


@dataclass
class Utilization:
    """The samples of one sampled run, and what they say."""

    samples: list[Sample] = field(default_factory=list)
    interval_s: float = 0.1
    gpu_name: str | None = None
    gpu_memory_total: int | None = None
    cpu_count: int = 1
    note: str = ""

    @property
    def has_gpu(self) -> bool:
        return self.gpu_name is not None

    def mean(self, name: str, start: float = 0.0, end: float = float("inf")) -> float | None:
        """Mean of one ``Sample`` field over samples taken in ``[start, end]`` seconds."""
        values = [getattr(s, name) for s in self.samples if start <= s.t <= end]
        values = [v for v in values if v is not None]
        return statistics.fmean(values) if values else None

    def peak(self, name: str) -> float | None:
        values = [getattr(s, name) for s in self.samples if getattr(s, name) is not None]
        return max(values) if values else None

    def summary(self) -> str:
        """One or two lines a person can read."""
        def fmt(value: float | None, unit: str = "%") -> str:
            return "n/a" if value is None else f"{value:.0f}{unit}"

        lines = [f"CPU {fmt(self.mean('cpu_percent'))} (this process "
                 f"{fmt(self.mean('process_cpu_percent'))} of {self.cpu_count} cores), "
                 f"{len(self.samples)} sample(s) every {self.interval_s * 1e3:.0f} ms"]
        if self.has_gpu:
            used = self.peak("gpu_memory_used")
            lines.append(f"GPU {self.gpu_name}: SM {fmt(self.mean('gpu_percent'))}, memory "
                         f"bandwidth {fmt(self.mean('gpu_memory_bandwidth_percent'))}, memory "
                         f"peak {fmt(used / 2**30 if used else None, ' GiB')}, PCIe in "
                         f"{fmt((self.mean('pcie_rx') or 0) / 1e9, ' GB/s')}")
        if self.note:
            lines.append(self.note)
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        return {"interval_s": self.interval_s, "gpu_name": self.gpu_name,
                "gpu_memory_total": self.gpu_memory_total, "cpu_count": self.cpu_count,
                "note": self.note, "samples": [s.__dict__ for s in self.samples]}


class UtilizationSampler:
    """Samples utilization every ``interval_s`` seconds between ``start()`` and ``stop()``.

    Args:
        interval_s: seconds between samples (at least 0.001).
        gpu_index: the NVIDIA GPU to read (NVML's index); None reads none.
    """

    def __init__(self, interval_s: float = 0.1, gpu_index: int | None = 0) -> None:
        if not isinstance(interval_s, (int, float)) or interval_s < 0.001:
            raise ConfigError(f"sampler interval_s must be a number of seconds >= 0.001; got "
                              f"{interval_s!r}")
        self.interval_s = float(interval_s)
        self.result = Utilization(interval_s=self.interval_s, cpu_count=os.cpu_count() or 1)
        self._gpu = _Nvml.open(gpu_index, self.result) if gpu_index is not None else None
        if gpu_index is None:
            self.result.note = "CPU figures only: no GPU was asked for"
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> UtilizationSampler:
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="autoopt-sampler", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> Utilization:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None
        if self._gpu is not None:
            self._gpu.close()
            self._gpu = None
        return self.result

    def __enter__(self) -> UtilizationSampler:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _run(self) -> None:
        origin = time.perf_counter()
        last_wall, last_proc, last_stat = origin, _process_seconds(), proc_stat()
        cores = self.result.cpu_count
        while True:
            # The last sample is taken as the workload ends, so short runs get one too.
            stopping = self._stop.wait(self.interval_s)
            now, proc, stat = time.perf_counter(), _process_seconds(), proc_stat()
            wall = max(now - last_wall, 1e-9)
            process = 100.0 * (proc - last_proc) / wall / cores
            machine = _busy_percent(last_stat, stat)
            gpu = self._gpu.read() if self._gpu is not None else {}
            self.result.samples.append(Sample(now - origin,
                                              process if machine is None else machine,
                                              min(process, 100.0), **gpu))
            last_wall, last_proc, last_stat = now, proc, stat
            if stopping:
                return


def _process_seconds() -> float:
    # CLOCK_PROCESS_CPUTIME_ID: every thread of this process, at ns resolution (os.times
    # counts 10 ms ticks, too coarse for short intervals).
    return time.process_time()


def _busy_percent(before: tuple[int, int] | None, after: tuple[int, int] | None,
                  ) -> float | None:
    if before is None or after is None or after[1] <= before[1]:
        return None
    return 100.0 * (after[0] - before[0]) / (after[1] - before[1])


class _Nvml:
    """The few NVML calls the sampler makes, opened once; any failure means CPU only."""

    def __init__(self, pynvml: Any, handle: Any) -> None:
        self.pynvml = pynvml
        self.handle = handle

    @classmethod
    def open(cls, index: int, result: Utilization) -> _Nvml | None:
        try:
            import pynvml
        except ImportError:
            result.note = ("CPU figures only: pynvml is not installed (pip install "
                           "nvidia-ml-py for GPU utilization)")
            return None
        try:
            pynvml.nvmlInit()
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            name = pynvml.nvmlDeviceGetName(handle)
            result.gpu_name = name.decode() if isinstance(name, bytes) else str(name)
            result.gpu_memory_total = int(pynvml.nvmlDeviceGetMemoryInfo(handle).total)
        except Exception as exc:  # noqa: BLE001 - NVMLError subclasses: no driver, no GPU
            result.note = f"CPU figures only: no NVIDIA GPU could be read ({exc})"
            return None
        return cls(pynvml, handle)

    def read(self) -> dict[str, Any]:
        nv, h = self.pynvml, self.handle
        values: dict[str, Any] = {}
        try:
            rates = nv.nvmlDeviceGetUtilizationRates(h)
            values.update(gpu_percent=float(rates.gpu),
                          gpu_memory_bandwidth_percent=float(rates.memory))
            values["gpu_memory_used"] = int(nv.nvmlDeviceGetMemoryInfo(h).used)
            # KB/s over NVML's last 20 ms window.
            values["pcie_tx"] = 1e3 * nv.nvmlDeviceGetPcieThroughput(h, nv.NVML_PCIE_UTIL_TX_BYTES)
            values["pcie_rx"] = 1e3 * nv.nvmlDeviceGetPcieThroughput(h, nv.NVML_PCIE_UTIL_RX_BYTES)
        except Exception as exc:  # noqa: BLE001 - a counter this GPU lacks stays None
            log.debug("NVML read failed: %s", exc)
        return values

    def close(self) -> None:
        try:
            self.pynvml.nvmlShutdown()
        except Exception:  # noqa: BLE001 - shutting down a library that failed is harmless
            pass
