"""Whole-step remedies: how a training step runs around the model, beyond what ``optimize``
rewrites in its graph. ``Diagnosis.apply()`` tries each, keeps it only where the measured step
is faster, and reports it either way.

- ``fused``: the optimizer's update as one fused kernel per dtype (``fused=True``, for Adam,
  AdamW, SGD, Adagrad on CPU and CUDA), else as multi-tensor ``foreach`` kernels, instead of a
  Python loop of small ops per parameter. It runs on a copy of your optimizer (same class,
  hyperparameters and state, over the optimized module's parameters); yours is never changed.
- ``tf32`` (CUDA, an fp32 step): fp32 matmuls and convolutions on TF32 tensor cores
  (``torch.backends.cuda.matmul.fp32_precision`` and ``torch.backends.cudnn.conv``'s set to
  ``"tf32"``; ``allow_tf32`` on a torch without them).
- ``cudnn_benchmark`` (CUDA, static shapes): cuDNN times its convolution algorithms for each
  shape and keeps the fastest (``torch.backends.cudnn.benchmark``).
- ``cuda_graph`` (CUDA, training, static shapes): the whole step — forward, loss, backward and
  the optimizer's update — recorded once as a CUDA graph and replayed with one launch.

The two ``torch.backends`` settings are process-wide; the diagnosis sets them for each of its
own steps and puts back what was there (``backend_settings``), so trying them changes nothing
else in your process. To keep one for your training, set it yourself (the report line says
how): it then holds for everything the process runs.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from autoopt.errors import ConfigError

log = logging.getLogger(__name__)

_GRAPH_WARMUP = 3  # steps on a side stream before recording: lazy state, cuBLAS workspaces


@dataclass(frozen=True)
class StepOptions:
    """How the diagnosis's step runs around the model.

    Args:
        optimizer: ``fused`` or ``foreach``: the optimizer copy's implementation ("": yours).
        tf32: fp32 matmuls and convolutions in TF32 (CUDA).
        cudnn_benchmark: cuDNN picks convolution algorithms by timing them (CUDA).
        cuda_graph: the whole training step replayed as one CUDA graph (CUDA).
    """

    optimizer: str = ""
    tf32: bool = False
    cudnn_benchmark: bool = False
    cuda_graph: bool = False


def eager(model: nn.Module) -> nn.Module:
    """The eager module whose parameters ``model`` trains (an OptimizedModule's ``.module``)."""
    from autoopt.module.optimized import OptimizedModule

    return model.module if isinstance(model, OptimizedModule) else model


def copy_optimizer(optimizer: torch.optim.Optimizer, source: nn.Module, target: nn.Module,
                   *, state: bool = True, **overrides: Any) -> torch.optim.Optimizer:
    """A new optimizer of ``optimizer``'s class over ``target``'s parameters: the same param
    groups and hyperparameters, a deep copy of its state (unless ``state=False``), and
    ``overrides`` (``fused=True``) in every group. ``optimizer``'s parameters are ``source``'s;
    ``target`` is a copy of it (parameters matched by name). ``optimizer`` itself is not
    changed.

    Raises:
        ConfigError: the optimizer holds a tensor that is not a parameter of ``source``.
        TypeError, RuntimeError, ValueError: the class refuses ``overrides`` (no ``fused``
            for these parameters' device or dtype, say).
    """
    names = {id(p): n for n, p in eager(source).named_parameters()}
    params = dict(eager(target).named_parameters())
    groups = []
    for group in optimizer.param_groups:
        missing = [p for p in group["params"] if id(p) not in names]
        if missing:
            raise ConfigError(f"the optimizer holds {len(missing)} tensor(s) that are not "
                              f"parameters of the model (shape {tuple(missing[0].shape)}); "
                              "pass the optimizer of this model's parameters")
        groups.append({**{k: v for k, v in group.items() if k != "params"}, **overrides,
                       "params": [params[names[id(p)]] for p in group["params"]]})
    accepted = inspect.signature(type(optimizer).__init__).parameters
    unknown = [k for k in overrides if k not in accepted]
    if unknown:
        raise TypeError(f"{type(optimizer).__name__} takes no {unknown}")
    new = type(optimizer)(groups, **overrides)
    if state:
        saved = copy.deepcopy(optimizer.state_dict())  # tensors of its own: yours never move
        for group in saved["param_groups"]:
            group.update(overrides)  # so loading puts the state where the overrides want it
        new.load_state_dict(saved)
    new.defaults.update({**optimizer.defaults, **overrides})
    return new


def fused_overrides(optimizer: torch.optim.Optimizer, model: nn.Module,
                    ) -> tuple[dict[str, Any], str]:
    """The overrides that fuse ``optimizer``'s update here, and what they are called:
    ``({"fused": True, "foreach": False}, "fused")``, ``({"foreach": True}, "foreach")`` (a
    class without fused kernels, or whose fused kernels refuse these parameters), or
    ``({}, why not)``."""
    name = type(optimizer).__name__
    if not isinstance(optimizer, torch.optim.Optimizer):
        return {}, f"{name} is not a torch.optim optimizer"
    accepted = inspect.signature(type(optimizer).__init__).parameters
    groups = optimizer.param_groups
    if any(g.get("fused") for g in groups):
        return {}, f"{name} is fused already (fused=True)"
    if any(g.get("differentiable") for g in groups):
        return {}, f"{name} is differentiable=True, which fused kernels do not support"
    tried = []
    for overrides in ({"fused": True, "foreach": False}, {"foreach": True}):
        if not set(overrides) <= set(accepted):
            tried.append(f"{name} takes no {next(iter(overrides))}=")
            continue
        if "foreach" in overrides and len(overrides) == 1 and \
                any(g.get("foreach") for g in groups):
            tried.append(f"{name} runs foreach=True already")
            continue
        try:
            copy_optimizer(optimizer, model, model, state=False, **overrides)  # a probe
        except (RuntimeError, TypeError, ValueError) as exc:
            tried.append(f"{'fused' if 'fused' in overrides else 'foreach'}: "
                         f"{str(exc).splitlines()[0][:120]}")
            continue
        return overrides, "fused" if overrides.get("fused") else "foreach"
    return {}, "; ".join(tried)


def optimizer_overrides(optimizer: torch.optim.Optimizer, model: nn.Module,
                        options: StepOptions) -> dict[str, Any]:
    """What the optimizer copy for ``options`` sets in each group."""
    overrides: dict[str, Any] = {}
    if options.optimizer:
        overrides.update(fused_overrides(optimizer, model)[0])
    accepted = inspect.signature(type(optimizer).__init__).parameters
    if options.cuda_graph and "capturable" in accepted:
        overrides["capturable"] = True  # its step counters on the device, as a graph needs
    return overrides


@contextlib.contextmanager
def backend_settings(options: StepOptions) -> Iterator[None]:
    """``options``' process-wide ``torch.backends`` settings for the block, then what was
    there before (a block that sets none changes nothing)."""
    if not (options.tf32 or options.cudnn_benchmark):
        yield
        return
    places = [(torch.backends.cudnn, "benchmark", True)] if options.cudnn_benchmark else []
    if options.tf32:
        places += _tf32_places()
    saved = [(holder, name, getattr(holder, name)) for holder, name, _ in places]
    try:
        for holder, name, value in places:
            setattr(holder, name, value)
        yield
    finally:
        for holder, name, value in reversed(saved):
            setattr(holder, name, value)


def _tf32_places() -> list[tuple[Any, str, Any]]:
    """Where TF32 is switched on for fp32 matmuls and convolutions, and the value that does:
    ``fp32_precision = "tf32"`` where this torch has it (set through the legacy
    ``allow_tf32`` and put back through the new API, torch refuses to read either flag
    after), else ``allow_tf32 = True``."""
    matmul, cudnn = torch.backends.cuda.matmul, torch.backends.cudnn
    conv = getattr(cudnn, "conv", None)
    if hasattr(matmul, "fp32_precision") and conv is not None and \
            hasattr(conv, "fp32_precision"):
        return [(matmul, "fp32_precision", "tf32"), (conv, "fp32_precision", "tf32")]
    return [(matmul, "allow_tf32", True), (cudnn, "allow_tf32", True)]


def _tf32_on() -> bool:
    return all(getattr(holder, name) == value for holder, name, value in _tf32_places())


def settings_off(device: torch.device) -> list[str]:
    """The ``torch.backends`` settings of a training step that are off in this process."""
    if device.type != "cuda":
        return []
    off = []
    if not _tf32_on():
        off.append("tf32")
    if not torch.backends.cudnn.benchmark:
        off.append("cudnn_benchmark")
    return off


class GraphedStep:
    """A whole training step (``step(inputs)``: forward, loss, backward, the optimizer's
    update) recorded as one CUDA graph for ``inputs``' shapes, dtypes and device.

    The recording fixes every address the step reads and writes: each call copies its inputs
    into the recorded buffers and replays. The gradients live in the graph's memory (the
    update reads them there), so they are not dropped between steps; the optimizer needs its
    state on the device (``capturable=True`` where the class has it).

    Raises:
        RuntimeError: the step cannot be recorded (a host sync, a CPU tensor), with why.
    """

    def __init__(self, step: Callable[[Any], None], inputs: Any, device: torch.device,
                 zero_grad: Callable[[], None]) -> None:
        leaves, self._spec = pytree.tree_flatten(inputs)
        self._static = [x.clone() if isinstance(x, torch.Tensor) else x for x in leaves]
        self._signature = _signature(leaves)
        static = pytree.tree_unflatten(self._static, self._spec)
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(_GRAPH_WARMUP):
                zero_grad()
                step(static)
        torch.cuda.current_stream(device).wait_stream(side)
        zero_grad()  # the recorded backward allocates the gradients in the graph's pool
        self._graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self._graph):
            step(static)

    def matches(self, inputs: Any) -> bool:
        """Whether ``inputs`` have the recorded structure, shapes, dtypes and devices."""
        leaves, spec = pytree.tree_flatten(inputs)
        return spec == self._spec and _signature(leaves) == self._signature

    def __call__(self, inputs: Any) -> None:
        for buffer, value in zip(self._static, pytree.tree_leaves(inputs), strict=True):
            if isinstance(buffer, torch.Tensor):
                buffer.copy_(value, non_blocking=True)
        self._graph.replay()


def _signature(leaves: list[Any]) -> list[Any]:
    return [(tuple(x.shape), x.dtype, x.device) if isinstance(x, torch.Tensor) else repr(x)
            for x in leaves]
