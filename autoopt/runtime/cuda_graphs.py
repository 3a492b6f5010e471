"""Replay a static-shape inference graph as one CUDA graph: one launch instead of hundreds.

A model made of many small kernels spends its time launching them (the GPU idles between
launches while Python and the driver queue the next one). ``torch.cuda.CUDAGraph`` records
every launch once and replays them all with one call. The recording fixes the memory it reads
and writes, so each call copies its inputs into the recorded input buffers and returns copies
of the recorded outputs (the next replay overwrites them). What the function writes into its
inputs (a decode step's static KV cache, written at the step's position) is written into the
recorded buffers, so it is copied back into the caller's tensors after each replay.

Only for inference calls with static shapes on one CUDA device: autoopt's signature guard
sends any other shape, dtype or device to a new capture, and a graph that cannot be recorded
(a host sync, a CPU tensor) keeps running as plain kernels, with the reason in the report.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
from torch.utils import _pytree as pytree

log = logging.getLogger(__name__)

_WARMUP = 3  # runs on a side stream before recording: lazy inits, cuBLAS workspaces, autotune


class CudaGraphRunner:
    """``fn`` recorded for the tensors of ``args``/``kwargs``; call it with inputs of the same
    structure, shapes, dtypes and device.

    Args:
        fn: the function to record (an optimized graph module).
        args, kwargs: example inputs; their tensors must all be on one CUDA device.

    Raises:
        RuntimeError: the function cannot be recorded (why is in the message).
    """

    def __init__(self, fn: Callable[..., Any], args: tuple[Any, ...],
                 kwargs: dict[str, Any]) -> None:
        leaves, self._spec = pytree.tree_flatten((args, kwargs))
        tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
        devices = {t.device for t in tensors}
        if len(devices) != 1 or next(iter(devices)).type != "cuda":
            raise RuntimeError(f"inputs must all be on one CUDA device; got "
                               f"{sorted(map(str, devices))}")
        self.device = next(iter(devices))
        self._is_tensor = [isinstance(x, torch.Tensor) for x in leaves]
        self._static = [x.clone() if isinstance(x, torch.Tensor) else x for x in leaves]
        static_args, static_kwargs = pytree.tree_unflatten(self._static, self._spec)
        versions = [x._version if isinstance(x, torch.Tensor) else None for x in self._static]
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.no_grad(), torch.cuda.stream(side):
            for _ in range(_WARMUP):
                fn(*static_args, **static_kwargs)
        torch.cuda.current_stream(self.device).wait_stream(side)
        # The inputs the function writes in place: their buffers' version counters moved.
        self._written = [i for i, (x, v) in enumerate(zip(self._static, versions, strict=True))
                         if isinstance(x, torch.Tensor) and x._version != v]
        self._graph = torch.cuda.CUDAGraph()
        with torch.no_grad(), torch.cuda.graph(self._graph):
            self._outputs = fn(*static_args, **static_kwargs)
        out_leaves = pytree.tree_leaves(self._outputs)
        if any(isinstance(t, torch.Tensor) and t.device != self.device for t in out_leaves):
            raise RuntimeError("an output is not on the graph's device")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        leaves = pytree.tree_leaves((args, kwargs))
        for buffer, value, is_tensor in zip(self._static, leaves, self._is_tensor, strict=True):
            if is_tensor:
                buffer.copy_(value, non_blocking=True)
        self._graph.replay()
        for i in self._written:
            leaves[i].copy_(self._static[i], non_blocking=True)
        return pytree.tree_map_only(torch.Tensor, torch.Tensor.clone, self._outputs)


def record(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any],
           ) -> tuple[Callable[..., Any], str]:
    """``(runner, "")`` with ``fn`` recorded as a CUDA graph, or ``(fn, why not)``."""
    if torch.is_grad_enabled():
        return fn, "gradients are enabled (CUDA graphs are used for inference calls only)"
    try:
        return CudaGraphRunner(fn, args, kwargs), ""
    except Exception as exc:  # noqa: BLE001 - the plain graph still runs; the reason is kept
        log.info("CUDA graph recording failed: %s", exc)
        text = str(exc).strip().splitlines()
        return fn, f"{type(exc).__name__}: {text[0][:200] if text else ''}"
