"""How fast a device multiplies matrices in each floating dtype: whether fp16 or bf16 pays.

fp32 and the device's usual half type (fp16 on a GPU, bf16 on a CPU) come from the roofline
ceilings in ``device``; any other dtype is measured the same way (a 512x512 matmul on a CPU,
2048 on a GPU, its fastest runs) and cached on disk per device, thread count and library
versions. As with the ceilings, a figure is the most the device was seen to reach: measured
again, or seen above it (``raise_matmul_flops``), it only goes up.
"""

from __future__ import annotations

import torch

from .cache import CostCache, library_versions
from .device import MEASURE_METHOD, device_info, gemm_flops, raise_ceilings


def matmul_flops(device: str | torch.device, dtype: torch.dtype,
                 cache: CostCache | None = None, *, remeasure: bool = False) -> float:
    """FLOP/s of a square matmul in ``dtype`` on ``device``; 0.0 where the dtype is unsupported.

    ``remeasure`` measures again even if cached, keeping the higher figure."""
    dev = torch.device(device)
    cache = cache if cache is not None else CostCache.default()
    half = torch.float16 if dev.type == "cuda" else torch.bfloat16
    if dtype in (torch.float32, half):  # the roofline ceilings measure these two already
        ceilings = device_info(dev, cache=cache, remeasure=remeasure).ceilings
        assert ceilings is not None
        return ceilings.matmul_flops if dtype == torch.float32 else ceilings.half_matmul_flops
    key = _key(dev, dtype)
    stored = cache.get(key, ("flops",))
    current = stored is not None and stored.get("method") == MEASURE_METHOD
    if current and not remeasure:
        return float(stored["flops"])  # type: ignore[index]
    n = 2048 if dev.type == "cuda" else 512
    try:
        generator = torch.Generator(dev).manual_seed(0)  # the global RNG stays the user's
        a = torch.randn(n, n, device=dev, generator=generator).to(dtype)
        b = torch.randn(n, n, device=dev, generator=generator).to(dtype)
        flops = gemm_flops(a, b, dev)
    except RuntimeError:  # no kernel for this dtype on this device
        flops = 0.0
    if current:
        flops = max(flops, float(stored["flops"]))  # type: ignore[index]
    cache.put(key, {"flops": flops, "method": MEASURE_METHOD})
    return flops


def raise_matmul_flops(device: str | torch.device, dtype: torch.dtype, observed: float,
                       cache: CostCache | None = None) -> float:
    """Record ``observed`` FLOP/s of ``dtype`` matmuls seen on ``device`` (a step's GEMMs ran
    that fast): a cached peak below it becomes it. Returns the peak after."""
    dev = torch.device(device)
    cache = cache if cache is not None else CostCache.default()
    half = torch.float16 if dev.type == "cuda" else torch.bfloat16
    if dtype in (torch.float32, half):
        field = "matmul_flops" if dtype == torch.float32 else "half_matmul_flops"
        return getattr(raise_ceilings(dev, cache, **{field: observed}), field)
    peak = matmul_flops(dev, dtype, cache)
    if observed > peak:
        cache.put(_key(dev, dtype), {"flops": observed, "method": MEASURE_METHOD})
    return max(peak, observed)


def _key(dev: torch.device, dtype: torch.dtype) -> str:
    info = device_info(dev, measure=False)
    return (f"matmul_flops|{dtype}|{info.name}|{info.device}|threads={torch.get_num_threads()}|"
            f"{library_versions()}")
