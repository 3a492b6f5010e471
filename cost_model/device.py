"""Facts about the target device: what it is, and the ceilings a roofline needs.

Names, memory and clocks come from ``pynvml`` (package ``nvidia-ml-py``) and ``torch.cuda`` on
a GPU, from the OS on the CPU. Peak FLOP/s, memory bandwidth and per-op overhead are *measured*
with small benchmarks (spec sheets overstate what PyTorch reaches), and cached on disk.

A ceiling is the most this device was seen to reach: each is timed by its fastest runs (a
loaded machine slows some runs, never speeds one up), a measurement taken again keeps the
higher figure of the two, and a throughput seen elsewhere above a ceiling raises it
(``raise_ceilings``). A ceiling measured while other processes held the cores (an fp32 GEMM
peak of 39 GFLOP/s cached on an EPYC that reaches 220) so cannot stay in the cache.
"""

from __future__ import annotations

import logging
import os
import platform
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from .cache import CostCache, library_versions
from .timing import best_seconds, median_seconds

log = logging.getLogger(__name__)

# How the ceilings were measured, stored with them: entries measured another way (1: the median
# of five runs, which a loaded machine drags down) are measured again rather than kept.
MEASURE_METHOD = 2
# Throughputs (higher is the ceiling) and costs (lower is) among the Ceilings fields.
_HIGHER = ("matmul_flops", "half_matmul_flops", "memory_bandwidth", "host_link_bandwidth")
_LOWER = ("op_overhead_s",)


@dataclass(frozen=True)
class Ceilings:
    """Measured limits on this device with the current thread count.

    Args:
        matmul_flops: FLOP/s of a large fp32 matmul.
        half_matmul_flops: FLOP/s of a large fp16 (GPU) or bf16 (CPU) matmul; 0 if unsupported.
        memory_bandwidth: bytes/s of a large copy (read plus write).
        op_overhead_s: time of a one-element op: dispatch and launch cost per node.
        host_link_bandwidth: host→device bytes/s from pinned memory (GPU only, else 0).
    """

    matmul_flops: float
    half_matmul_flops: float
    memory_bandwidth: float
    op_overhead_s: float
    host_link_bandwidth: float = 0.0


@dataclass(frozen=True)
class DeviceInfo:
    """What autoopt knows about one device.

    Args:
        device: ``cpu`` or ``cuda:N``.
        name: the product name.
        memory_total, memory_free: bytes (host RAM for the CPU).
        threads: intra-op threads (CPU) or SM count (GPU): the parallelism a kernel gets.
        clock_mhz: SM clock (GPU) where known.
        link: PCIe/NVLink description where known, e.g. ``PCIe gen4 x16, 8 NVLink links``.
        link_bandwidth: theoretical host link bytes/s from the link description (0 unknown).
        ceilings: measured roofline ceilings, or None until measured.
        notes: what could not be read and why (e.g. pynvml missing).
    """

    device: str
    name: str
    memory_total: int
    memory_free: int
    threads: int
    clock_mhz: int = 0
    link: str = ""
    link_bandwidth: float = 0.0
    ceilings: Ceilings | None = None
    notes: tuple[str, ...] = field(default_factory=tuple)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def device_info(device: str | torch.device = "cpu", *, measure: bool = True,
                cache: CostCache | None = None, remeasure: bool = False) -> DeviceInfo:
    """Describe ``device``; with ``measure`` also its ceilings (cached per device, threads and
    library versions, so measured once).

    Args:
        device: ``cpu`` or ``cuda[:N]``.
        measure: also the ceilings (measured on first use, about a second, then cached).
        cache: where ceilings are kept (default: the user's cost cache).
        remeasure: measure the ceilings again even if cached; the cache keeps the higher of
            the two measurements of each (a figure seen to be too low, say).
    """
    dev = torch.device(device)
    if dev.type == "cuda":
        info = _cuda_info(dev)
    elif dev.type == "cpu":
        info = _cpu_info()
    else:
        raise ValueError(f"unsupported device {dev}; autoopt's cost model knows cpu and cuda")
    if not measure:
        return info
    cache = cache if cache is not None else CostCache.default()
    key = _key(info)
    stored = cache.get(key, ())
    if stored is None or remeasure or stored.get("method") != MEASURE_METHOD:
        ceilings = measure_ceilings(dev)
        if stored is not None and stored.get("method") == MEASURE_METHOD:
            ceilings = _highest(_ceilings(stored), ceilings)
        cache.put(key, {**asdict(ceilings), "method": MEASURE_METHOD})
    else:
        ceilings = _ceilings(stored)
    return DeviceInfo(**{**asdict(info), "ceilings": ceilings, "notes": info.notes})


def raise_ceilings(device: str | torch.device, cache: CostCache | None = None,
                   **observed: float) -> Ceilings:
    """Record throughputs seen on ``device`` (``matmul_flops=2.1e11``): a cached ceiling below
    what was seen becomes what was seen, as the device evidently reaches it. Returns the
    ceilings after."""
    unknown = set(observed) - set(_HIGHER)
    if unknown:
        raise ValueError(f"raise_ceilings takes throughputs {_HIGHER}; got {sorted(unknown)}")
    cache = cache if cache is not None else CostCache.default()
    info = device_info(device, cache=cache)
    assert info.ceilings is not None
    raised = Ceilings(**{**asdict(info.ceilings), **{
        name: max(value, getattr(info.ceilings, name)) for name, value in observed.items()}})
    if raised != info.ceilings:
        log.info("ceilings of %s raised to what was seen: %s", info.device, observed)
        cache.put(_key(info), {**asdict(raised), "method": MEASURE_METHOD})
    return raised


def _key(info: DeviceInfo) -> str:
    return f"ceilings|{info.name}|{info.device}|threads={torch.get_num_threads()}|" \
           f"{library_versions()}"


def _ceilings(stored: dict[str, Any]) -> Ceilings:
    return Ceilings(**{k: v for k, v in stored.items() if k != "method"})


def _highest(a: Ceilings, b: Ceilings) -> Ceilings:
    """Each ceiling at its best of two measurements: the higher throughput, the lower cost."""
    best = {name: max(getattr(a, name), getattr(b, name)) for name in _HIGHER}
    best.update({name: min(getattr(a, name), getattr(b, name)) for name in _LOWER})
    return Ceilings(**best)


def _cpu_info() -> DeviceInfo:
    name = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    name = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    total = free = 0
    notes: list[str] = []
    try:
        with open("/proc/meminfo") as f:
            fields = {k: v for k, v in (line.split(":", 1) for line in f)}
        total = int(fields["MemTotal"].split()[0]) * 1024
        free = int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        try:
            total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
            free = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
        except (ValueError, OSError, AttributeError):
            notes.append("host memory size unavailable on this OS")
    return DeviceInfo("cpu", name, total, free, torch.get_num_threads(), notes=tuple(notes))


def _cuda_info(dev: torch.device) -> DeviceInfo:
    if not torch.cuda.is_available():
        raise RuntimeError(f"{dev} requested but torch.cuda.is_available() is False")
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    props = torch.cuda.get_device_properties(index)
    free, total = torch.cuda.mem_get_info(index)
    clock, link, link_bw, notes = 0, "", 0.0, []
    try:
        import pynvml
    except ImportError:
        notes.append("pynvml not installed (pip install nvidia-ml-py): no clocks or link facts")
    else:
        try:
            pynvml.nvmlInit()
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            clock = int(pynvml.nvmlDeviceGetMaxClockInfo(handle, pynvml.NVML_CLOCK_SM))
            gen = int(pynvml.nvmlDeviceGetMaxPcieLinkGeneration(handle))
            width = int(pynvml.nvmlDeviceGetMaxPcieLinkWidth(handle))
            # Per-lane payload rate by PCIe generation, GB/s (after encoding overhead).
            per_lane = {1: 0.25, 2: 0.5, 3: 0.985, 4: 1.969, 5: 3.938, 6: 7.563}.get(gen, 0.0)
            link_bw = per_lane * width * 1e9
            links = 0
            for i in range(18):
                try:
                    if pynvml.nvmlDeviceGetNvLinkState(handle, i):
                        links += 1
                except pynvml.NVMLError:
                    break
            link = f"PCIe gen{gen} x{width}" + (f", {links} NVLink links" if links else "")
        except Exception as exc:  # noqa: BLE001 - NVML errors (no driver) degrade to torch facts
            notes.append(f"NVML unavailable ({type(exc).__name__}: {exc}); torch.cuda facts only")
    return DeviceInfo(f"cuda:{index}", props.name, int(total), int(free),
                      props.multi_processor_count, clock, link, link_bw, notes=tuple(notes))


def eviction_bytes(dev: torch.device, *, last_level: bool = False) -> int:
    """Bytes to overwrite so a timed op finds nothing of its own in cache: twice the L2 (the
    per-core L2 from sysfs on a CPU, 2 MiB where unknown), or with ``last_level`` twice the
    last-level cache (a CPU's L3; a GPU's L2 either way)."""
    if dev.type == "cuda":
        index = dev.index if dev.index is not None else torch.cuda.current_device()
        l2 = getattr(torch.cuda.get_device_properties(index), "L2_cache_size", 0) or 2**25
        return 2 * int(l2)
    return 2 * cpu_cache_bytes(last_level=last_level)


# The most of the last-level cache a process keeps its data in between calls. sysfs reports
# the whole cache, which every core and tenant on it shares: a 2-vCPU VM on an Intel Xeon
# reports the socket's 260 MiB, and there one thread's GEMV sweep fell from 37 GB/s (weights
# in L2) to memory speed (14 GB/s) past 32-64 MiB of weights. Sized beyond it, the
# measurements that must find the weights out of cache (``packed_linear``'s one-row kernels)
# swept and evicted 390-520 MiB each, and a 380 MiB decoder counted as cached in bf16.
_HELD_LAST_LEVEL = 32 * 2**20
_SYSFS_CACHES = Path("/sys/devices/system/cpu/cpu0/cache")


def cpu_cache_bytes(*, last_level: bool = False) -> int:
    """The size of the first core's L2 cache, or of the last-level cache it shares (L3) as far
    as one process holds data there (at most 32 MiB), from sysfs; 2 MiB (L2) or 32 MiB (last
    level) where unknown."""
    sizes: dict[int, int] = {}
    try:
        for index in sorted(_SYSFS_CACHES.glob("index*")):
            if (index / "type").read_text().strip() == "Instruction":
                continue
            text = (index / "size").read_text().strip().upper()
            scale = {"K": 2**10, "M": 2**20}.get(text[-1], 1)
            sizes[int((index / "level").read_text())] = int(text.rstrip("KM")) * scale
    except (OSError, ValueError):
        sizes = {}
    if last_level:
        return min(sizes[max(sizes)], _HELD_LAST_LEVEL) if sizes else _HELD_LAST_LEVEL
    return sizes.get(2, 2 * 2**20)


def gemm_flops(a: torch.Tensor, b: torch.Tensor, dev: torch.device) -> float:
    """FLOP/s of ``a @ b`` (square) from its fastest runs. On a CPU with several threads it is
    timed on one thread too, keeping the higher figure: while another process holds a core,
    every multi-threaded GEMM waits for its descheduled thread (two threads of this EPYC with
    one core busy: 17 GFLOP/s at best, one thread alone 113), so a ceiling measured under
    load is never below what one core reaches. (``set_num_threads`` sets OpenMP's count for
    the calling thread: other threads' ops keep theirs.)"""
    n = a.shape[0]
    flops = 2 * n**3 / best_seconds(lambda i: torch.mm(a, b), dev)
    threads = torch.get_num_threads()
    if dev.type == "cpu" and threads > 1:
        torch.set_num_threads(1)
        try:
            flops = max(flops, 2 * n**3 / best_seconds(lambda i: torch.mm(a, b), dev))
        finally:
            torch.set_num_threads(threads)
    return flops


def measure_ceilings(dev: torch.device) -> Ceilings:
    """Measure matmul FLOP/s, copy bandwidth and per-op overhead on ``dev`` (about a second):
    each throughput from its fastest runs (``best_seconds``), the overhead as a median."""
    n = 2048 if dev.type == "cuda" else 512
    # A generator of its own: measuring must not move the global RNG a model's dropout draws.
    generator = torch.Generator(dev).manual_seed(0)
    a = torch.randn(n, n, device=dev, generator=generator)
    b = torch.randn(n, n, device=dev, generator=generator)
    matmul = gemm_flops(a, b, dev)
    half_dtype = torch.float16 if dev.type == "cuda" else torch.bfloat16
    try:
        half = gemm_flops(a.to(half_dtype), b.to(half_dtype), dev)
    except RuntimeError:
        half = 0.0
    numel = (256 if dev.type == "cuda" else 32) * 2**20 // 4
    src = torch.randn(numel, device=dev, generator=generator)
    dst = torch.empty_like(src)
    bandwidth = 2 * src.nbytes / best_seconds(lambda i: dst.copy_(src), dev)
    tiny_a, tiny_b = torch.ones(1, device=dev), torch.ones(1, device=dev)
    overhead = median_seconds(lambda i: torch.add(tiny_a, tiny_b), dev, warmup=20, repeats=51)
    link = 0.0
    if dev.type == "cuda":
        host = torch.empty(64 * 2**20, dtype=torch.uint8, pin_memory=True)
        target = torch.empty_like(host, device=dev)
        link = host.nbytes / best_seconds(lambda i: target.copy_(host, non_blocking=True),
                                          dev)
    return Ceilings(matmul, half, bandwidth, overhead, link)
