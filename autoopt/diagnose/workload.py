"""The diagnosis's workload: the model (a private copy), where its batches come from, and one
step timed in three phases (waiting for the batch, copying it to the device, computing).

A step runs the example inputs again or reads the next batch of a loader; in training it runs
backward too, and the update of the optimizer when one is given (a copy of it, over the copy of
the model). ``StepOptions`` say how the step runs around the model (a fused optimizer,
``torch.backends`` settings, a CUDA graph of the whole step: ``whole_step``).
``load_batches`` and ``console_progress`` are what ``autoopt diagnose`` feeds it.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import time
from collections.abc import Callable, Generator, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from autoopt.diagnose.whole_step import (
    GraphedStep,
    StepOptions,
    backend_settings,
    copy_optimizer,
    optimizer_overrides,
)
from autoopt.errors import ConfigError, InputError, ModelError

log = logging.getLogger(__name__)

Progress = Callable[[Iterable[Any], str], Iterable[Any]]


@dataclass(frozen=True)
class StepTimes:
    """Median seconds per step, by phase."""

    data_s: float
    transfer_s: float
    compute_s: float
    total_s: float


class Workload:
    """The model (a private copy), where its batches come from, and one timed step."""

    def __init__(self, model: nn.Module, data: Any, example_kwargs: Mapping[str, Any] | None,
                 device: str | torch.device | None, training: bool,
                 unpack: Callable[[Any], tuple[tuple[Any, ...], dict[str, Any]]] | None,
                 loss_fn: Callable[[Any, Any], torch.Tensor] | None,
                 optimizer: torch.optim.Optimizer | None = None,
                 options: StepOptions | None = None, keep_start: bool = False) -> None:
        params = list(model.parameters()) + list(model.buffers())
        self.device = torch.device(device) if device is not None else (
            params[0].device if params else torch.device("cpu"))
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ConfigError(f"diagnose device={device!r} asks for CUDA but no CUDA GPU is "
                              "available; use device='cpu'")
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        try:
            self.model = copy.deepcopy(model)
            self.copied = True
        except Exception as exc:  # noqa: BLE001 - e.g. a lock inside: run it and undo after
            log.info("diagnose cannot copy the model (%s); running it in place", exc)
            self.model, self.copied = model, False
        if params and params[0].device != self.device:
            if not self.copied:
                raise ModelError(f"diagnose would move the model to {self.device}, but it "
                                 f"cannot be copied and yours must not change; move it (and "
                                 f"its inputs) to {self.device} first")
            # Only when needed: moving an OptimizedModule drops its captured graphs.
            self.model.to(self.device)
        self.training = training
        self.loss_fn = loss_fn
        self.unpack = unpack or _default_unpack
        self.is_loader = not isinstance(data, (torch.Tensor, tuple))
        if self.is_loader and not isinstance(data, Iterable):
            raise InputError(f"diagnose data must be example inputs (a tensor or a tuple) or an "
                             f"iterable of batches (a DataLoader); got {type(data).__name__}")
        if self.is_loader and example_kwargs:
            raise InputError("example_kwargs go with example inputs, not with a DataLoader; "
                             "return keyword inputs from the batches (a dict) or use unpack=")
        self.source = data
        if not self.is_loader:
            inputs = (data,) if isinstance(data, torch.Tensor) else data
            self._example = self._to_device((inputs, dict(example_kwargs or {})))
        self.gpu_index = (self.device.index or 0) if self.device.type == "cuda" else None
        self.first_batch: Any = None
        self.options = options or StepOptions()
        # The optimizer's update ends each training step: a copy of the optimizer over the
        # copy of the model, so neither of yours changes.
        self.optimizer: torch.optim.Optimizer | None = None
        # The model and optimizer as they were before any step (``keep_start``), for
        # ``Diagnosis.apply`` to optimize: the steps move the copy's parameters.
        self.start: tuple[nn.Module, torch.optim.Optimizer | None] | None = None
        if optimizer is not None:
            if not training:
                raise ConfigError("diagnose optimizer= is for training=True: an inference "
                                  "step updates no parameters")
            if not self.copied:
                raise ConfigError("diagnose with optimizer= runs the optimizer's update on a "
                                  "copy of the model, and this model cannot be copied; "
                                  "diagnose it without optimizer=")
            overrides = optimizer_overrides(optimizer, model, self.options)
            self.optimizer = copy_optimizer(optimizer, model, self.model, **overrides)
        # Without an optimizer the steps still move the copy's buffers (BatchNorm statistics,
        # counters): a module optimized from it after the steps started from other values
        # than yours (BatchNorm's eval output off by 11%).
        if keep_start and self.copied and (self.optimizer is not None or (
                training and any(True for _ in self.model.buffers()))):
            start = copy.deepcopy(self.model)
            self.start = start, (copy_optimizer(self.optimizer, self.model, start)
                                 if self.optimizer is not None else None)
        self.shapes: set[tuple[Any, ...]] = set()  # the input signatures the steps saw
        self.graph_misses = 0  # steps whose shapes the CUDA graph was not recorded for
        self._graphed: GraphedStep | None = None

    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        """Set the train/eval mode for the run; a model run in place (not copied) gets its
        modes, gradients, buffers, Python attributes and RNG back afterwards."""
        if self.copied:
            self.model.train(self.training)
            yield
            return
        from autoopt.check.state import preserved

        modes = [(m, m.training) for m in self.model.modules()]
        grads = [(p, p.grad) for p in self.model.parameters()]
        try:
            with preserved(self.model):
                self.model.train(self.training)
                yield
        finally:
            for m, mode in modes:
                m.training = mode
            for p, grad in grads:
                p.grad = grad

    def example(self) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """One batch's inputs on the device (for capture and the roofline)."""
        if not self.is_loader:
            return self._example
        batch = self.first_batch if self.first_batch is not None else next(iter(self.source))
        return self._to_device(self.unpack(batch))

    def batches(self) -> Generator[Any, None, None]:
        """Batches forever: the example again and again, or the loader pass after pass."""
        if not self.is_loader:
            while True:
                yield None
        yielded = 0
        while True:
            empty = True
            it = iter(self.source)
            try:
                for batch in it:
                    empty = False
                    yielded += 1
                    if self.first_batch is None:
                        self.first_batch = batch
                    yield batch
            finally:
                close = getattr(it, "close", None)  # a prefetch pass: end its thread now
                if callable(close):
                    close()
            if empty and yielded:
                raise InputError(
                    f"diagnose's data yielded {yielded} batch(es), then none on its next pass: "
                    f"a generator or iterator cannot start again. Pass a DataLoader or a list "
                    f"(they can), or ask for fewer steps (warm-up and profiled steps count "
                    f"too).")
            if empty:
                raise InputError("diagnose's DataLoader yielded no batches")

    @property
    def static_shapes(self) -> bool:
        """Whether every step so far had the same input shapes (one signature)."""
        return len(self.shapes) <= 1

    def step(self, batches: Iterator[Any]) -> tuple[float, float, float, float, float]:
        """One step; returns (data, transfer, compute, total, process CPU during compute)."""
        start = time.perf_counter()
        batch = next(batches)
        loaded = time.perf_counter()
        if self.is_loader:
            batch = self._to_device(batch)  # the loss sees the batch where the model runs
        inputs = batch if self.is_loader else self._example
        self.shapes.add(tuple((tuple(t.shape), t.dtype) for t in pytree.tree_leaves(inputs)
                              if isinstance(t, torch.Tensor)))
        self._sync()
        copied = time.perf_counter()
        cpu_before = _process_seconds()
        with torch.no_grad() if not self.training else contextlib.nullcontext(), \
                backend_settings(self.options):
            self._compute(inputs)
        self._sync()
        done = time.perf_counter()
        return (loaded - start, copied - loaded, done - copied, done - start,
                _process_seconds() - cpu_before)

    def _compute(self, inputs: Any) -> None:
        """The step's work on ``inputs`` (a batch, or the example's ``(args, kwargs)``),
        replayed as a CUDA graph where the options say so and the shapes were recorded."""
        if self.options.cuda_graph and self.training and self.device.type == "cuda":
            if self._graphed is None:
                self._graphed = GraphedStep(self._run, inputs, self.device, self._zero_grad)
            if self._graphed.matches(inputs):
                self._graphed(inputs)  # its gradients live in the graph; none to drop
                return
            self.graph_misses += 1
            self._zero_grad()  # the graph's gradients are not this step's to add to
        self._run(inputs)
        if self.training:
            self._zero_grad()

    def _run(self, inputs: Any) -> None:
        """Forward; in training also the loss, backward and the optimizer's update."""
        batch, (args, kwargs) = (inputs, self.unpack(inputs)) if self.is_loader else \
            (None, inputs)
        out = self.model(*args, **kwargs)
        if self.training:
            loss = self.loss_fn(out, batch) if self.loss_fn else default_loss(out)
            loss.backward()
            if self.optimizer is not None:
                self.optimizer.step()

    def _zero_grad(self) -> None:
        self.model.zero_grad(set_to_none=True)

    def _to_device(self, value: Any) -> Any:
        return pytree.tree_map_only(torch.Tensor,
                                    lambda t: t.to(self.device, non_blocking=True), value)

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def _default_unpack(batch: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    if isinstance(batch, Mapping):
        return (), dict(batch)
    if isinstance(batch, (tuple, list)):
        return (batch[0],), {}
    return (batch,), {}


def default_loss(out: Any) -> torch.Tensor:
    """The loss of a training step the user gave none for: the mean of each floating output
    that requires grad, summed."""
    leaves = [t for t in pytree.tree_leaves(out)
              if isinstance(t, torch.Tensor) and t.is_floating_point() and t.requires_grad]
    if not leaves:
        raise ModelError("training=True but the model's output has no floating tensor that "
                         "requires grad; pass loss_fn=(output, batch) -> scalar")
    return sum(t.float().mean() for t in leaves)  # type: ignore[return-value]


def _process_seconds() -> float:
    return time.process_time()


def batch_size(w: Workload) -> int | None:
    """The first input's first dimension (None: no tensor input, or a loader that cannot
    restart)."""
    try:
        args, kwargs = w.example()
    except Exception:  # noqa: BLE001 - a loader that cannot restart has no known batch size
        return None
    for t in pytree.tree_leaves((args, kwargs)):
        if isinstance(t, torch.Tensor) and t.dim() > 0:
            return int(t.shape[0])
    return None


def console_progress(iterable: Iterable[Any], description: str) -> Iterable[Any]:
    """A ``tqdm`` progress bar on stderr (shown on a terminal only), or the iterable as is."""
    try:
        from tqdm import tqdm
    except ImportError:
        return iterable
    return tqdm(iterable, desc=description, leave=False, disable=None)


def load_batches(spec: str) -> Iterable[Any]:
    """``package.module:name`` or ``path/to/file.py:name`` -> an iterable of batches (``name``
    is called with no arguments when it is a function, e.g. one that builds a DataLoader)."""
    import importlib
    import importlib.util
    from pathlib import Path

    from autoopt.errors import ModelSpecError

    if ":" not in spec:
        raise ModelSpecError(f"--loader {spec!r} must be 'package.module:name' or "
                             "'path/to/file.py:name'")
    where, name = spec.rsplit(":", 1)
    try:
        if where.endswith(".py"):
            found = importlib.util.spec_from_file_location(f"_autoopt_loader_{Path(where).stem}",
                                                           where)
            if found is None or found.loader is None or not Path(where).is_file():
                raise ModelSpecError(f"--loader {spec!r}: no such Python file {where!r}")
            source = importlib.util.module_from_spec(found)
            found.loader.exec_module(source)
        else:
            source = importlib.import_module(where)
        target = getattr(source, name)
        batches = target() if callable(target) and not isinstance(target, Iterable) else target
    except ModelSpecError:
        raise
    except Exception as exc:
        raise ModelSpecError(f"--loader {spec!r} could not be loaded: {type(exc).__name__}: "
                             f"{exc}") from exc
    if not isinstance(batches, Iterable):
        raise ModelSpecError(f"--loader {spec!r} gave {type(batches).__name__}, not an "
                             "iterable of batches (a DataLoader)")
    return batches
