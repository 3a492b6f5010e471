"""``memory_budget`` and ``memory_modes``, parsed and checked: a size (``"6GiB"``, bytes) or a
fraction of the device's memory, and the modes the plan may use (keep, recompute, offload).

The budget bounds the activations autograd saves for backward (parameters, gradients and
optimizer state are not part of it); ``autoopt.runtime.budget`` plans and applies it.
"""

from __future__ import annotations

import re
from typing import Any

from autoopt.errors import ConfigError
from autoopt.planning.segments import MODES

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([a-z]*)\s*$", re.IGNORECASE)


def parse_budget(value: Any, name: str = "memory_budget",
                 fraction_of: str = "device memory") -> int | float:
    """Check a ``memory_budget``: bytes (int), a fraction of device memory in (0, 1] (float),
    or a size string (``"8GiB"``, ``"512MiB"``, ``"1.5GB"``); returns bytes or the fraction.
    ``name`` and ``fraction_of`` say which option it is in the error (``optimize_memory``).

    Raises:
        ConfigError: anything else, zero or negative.
    """
    hint = (f"{name} is bytes (an int), a fraction of {fraction_of} in (0, 1] (a float) "
            "or a size string like '8GiB' or '512MiB'")
    if isinstance(value, bool):
        raise ConfigError(f"{hint}; got {value!r}")
    if isinstance(value, int):
        if value <= 0:
            raise ConfigError(f"{hint}; got {value}, which is not positive")
        return value
    if isinstance(value, float):
        if not 0 < value <= 1:
            raise ConfigError(f"{hint}; got the float {value}, outside (0, 1] (pass bytes as "
                              f"an int or a string)")
        return value
    if isinstance(value, str):
        match = _SIZE.match(value)
        unit = match.group(2).lower() if match else ""
        if match is None or unit not in _UNITS:
            raise ConfigError(f"{hint}; cannot read {value!r} (units: B, KB, MB, GB, KiB, MiB, "
                              f"GiB)")
        size = int(float(match.group(1)) * _UNITS[unit])
        if size <= 0:
            raise ConfigError(f"{hint}; got {value!r}, which is not positive")
        return size
    raise ConfigError(f"{hint}; got {type(value).__name__} {value!r}")


def parse_modes(modes: Any) -> tuple[str, ...]:
    """Check ``memory_modes``: a non-empty subset of ``keep``, ``offload``, ``selective``,
    ``recompute`` (``keep`` is allowed whatever is asked: a segment may stay as it is)."""
    chosen = (modes,) if isinstance(modes, str) else tuple(modes)
    bad = [m for m in chosen if m not in MODES]
    if bad or not chosen:
        raise ConfigError(f"memory_modes must be drawn from {list(MODES)}; got {list(chosen)}")
    return chosen


def budget_bytes(budget: int | float, device_memory: int) -> int:
    """Bytes for a parsed budget: a fraction is of ``device_memory``."""
    return int(budget * device_memory) if isinstance(budget, float) else int(budget)
