"""The decode step of one ``generate`` call bound to its cache, for the steps after the first.

Every decode step of a call feeds the model the same cache object and inputs of the same
sizes: its first step finds the step graph (the cache taken apart, the graph looked up by the
cache's structure and the inputs' signature) and the steps after it only need to see that
nothing of that changed: the same cache, the same tensors in its layers, the same keyword
names and non-tensor values, tensors of the same sizes, dtypes, devices and strides. Those
checks cost a few microseconds where the first step's cost 0.2 ms, and the graph is called
through ``OptimizedModule.runner_for``, which skips matching the 114 inputs again (76 us) but
not the module's own checks.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from autoopt.compile.guards import same_value

_Layout = tuple[torch.Size, torch.dtype, torch.device, tuple[int, ...]]


def _layout(t: torch.Tensor) -> _Layout:
    return t.shape, t.dtype, t.device, t.stride()


class BoundStep:
    """A decode step graph and the call it was found for.

    Args:
        cache: the cache object the call's steps pass (``name``, the keyword it comes by).
        tensors: the cache's tensors, in the order the graph takes them.
        inputs: the step's other inputs as the graph was called with them.
        run: the graph's call (``OptimizedModule.runner_for``).
    """

    def __init__(self, name: str, cache: Any, layers: list[Any], tensors: list[torch.Tensor],
                 inputs: Mapping[str, Any], run: Callable[..., Any]) -> None:
        self.name = name
        self.cache = cache
        self._layers = layers
        self._keys = [layer.keys for layer in layers]
        self.tensors = tensors
        self._tensors = {k: _layout(v) for k, v in inputs.items()
                         if isinstance(v, torch.Tensor)}
        self._values = {k: v for k, v in inputs.items() if not isinstance(v, torch.Tensor)}
        self._count = len(inputs)
        self.run = run

    def inputs_of(self, kwargs: Mapping[str, Any]) -> dict[str, Any] | None:
        """The graph's inputs for a step called with ``kwargs``, or None where this step is
        not one the binding serves (the caller then takes the full route)."""
        if kwargs.get(self.name) is not self.cache or any(
                layer.keys is not keys for layer, keys in zip(self._layers, self._keys,
                                                               strict=True)):
            return None
        inputs = {}
        for key, value in kwargs.items():
            if key == self.name or value is None:
                continue
            if isinstance(value, torch.Tensor):
                layout = self._tensors.get(key)
                if layout is None or _layout(value) != layout:
                    return None
            elif key not in self._values or not same_value(self._values[key], value):
                return None
            inputs[key] = value
        inputs.setdefault("return_dict", True)  # as the full route sets it
        return inputs if len(inputs) == self._count else None
