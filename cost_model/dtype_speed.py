"""How fast a device multiplies matrices in each floating dtype: whether fp16 or bf16 pays.

fp32 and the device's usual half type (fp16 on a GPU, bf16 on a CPU) come from the roofline
ceilings in ``device``; any other dtype is measured the same way (a 512x512 matmul on a CPU,
2048 on a GPU, medians) and cached on disk per device, thread count and library versions.
"""

from __future__ import annotations

import torch

from .cache import CostCache, library_versions
from .device import device_info
from .timing import median_seconds


def matmul_flops(device: str | torch.device, dtype: torch.dtype,
                 cache: CostCache | None = None) -> float:
    """FLOP/s of a square matmul in ``dtype`` on ``device``; 0.0 where the dtype is unsupported."""
    dev = torch.device(device)
    cache = cache if cache is not None else CostCache.default()
    half = torch.float16 if dev.type == "cuda" else torch.bfloat16
    if dtype in (torch.float32, half):  # the roofline ceilings measure these two already
        ceilings = device_info(dev, cache=cache).ceilings
        assert ceilings is not None
        return ceilings.matmul_flops if dtype == torch.float32 else ceilings.half_matmul_flops
    info = device_info(dev, measure=False)
    key = (f"matmul_flops|{dtype}|{info.name}|{info.device}|threads={torch.get_num_threads()}|"
           f"{library_versions()}")
    stored = cache.get(key)
    if stored is not None:
        return float(stored["flops"])
    n = 2048 if dev.type == "cuda" else 512
    try:
        generator = torch.Generator(dev).manual_seed(0)  # the global RNG stays the user's
        a = torch.randn(n, n, device=dev, generator=generator).to(dtype)
        b = torch.randn(n, n, device=dev, generator=generator).to(dtype)
        flops = 2 * n**3 / median_seconds(lambda i: torch.mm(a, b), dev, repeats=5)
    except RuntimeError:  # no kernel for this dtype on this device
        flops = 0.0
    cache.put(key, {"flops": flops})
    return flops
