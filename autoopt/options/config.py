"""The options of ``autoopt.optimize``, with their meaning and checks."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from autoopt.check.compare import Tolerance
from autoopt.errors import ConfigError
from autoopt.options.backends import (
    BACKENDS,
    BACKENDS_VARIABLE,
    INDUCTOR_OPTIONS,
    STATIC_INT8,
)
from autoopt.options.calibration import calibration
from autoopt.options.memory import parse_budget, parse_modes
from autoopt.passes import LOWERING, PIPELINE, PassFn
from autoopt.passes.precision import DEFAULT_TOLERANCE, PRECISIONS

CAPTURE_METHODS = ("export", "symbolic_trace", "dynamo")


@dataclass(frozen=True)
class OptimizeConfig:
    """How ``optimize`` works; every field has a safe default.

    Args:
        disable: pass names to leave out (see ``autoopt.passes.PASS_NAMES``).
        pipeline: replace the pass list itself, as ``(name, fn)`` pairs; None is the default.
        verify: compare against eager after optimizing and roll back passes that change results.
        debug: lint and verify after every pass instead of once at the end.
        random_inputs: fresh random input sets to verify on, besides the example inputs.
        tolerances: per-dtype ``Tolerance`` overrides for verification.
        capture: capture methods to try, in order (``export``, ``symbolic_trace``, ``dynamo``);
            when all fail the model runs eagerly.
        max_specializations: input signatures (shapes, flags, modes) to capture before new
            ones run eagerly.
        pass_options: per-pass options, ``{"pass_name": {"option": value}}``.
        memory_budget: training only: bytes of saved activations allowed on the device (an
            int, a fraction of device memory in (0, 1], or a string like ``"8GiB"``); autoopt
            keeps, offloads or recomputes them to fit (see ``autoopt.options.memory``).
        memory_modes: the ways ``memory_budget`` may use (``keep``, ``offload``,
            ``selective``, ``recompute``); default: all on a GPU, all but offload on a CPU.
        cuda_graphs: on a CUDA device, replay each static-shape inference graph as one CUDA
            graph (one launch per call instead of one per kernel); checked against eager too.
        backend: the one backend to execute every optimized graph (``aten``, ``hybrid``,
            ``inductor`` or ``onnxruntime``); where it cannot (not installed, fails, differs
            from eager), optimize raises. None: the fastest of ``backends``, measured.
        backends: the backends to measure and choose from per graph; one that cannot lower
            a graph is skipped with its reason in the report. None: all of ``BACKENDS``, or
            those the ``AUTOOPT_BACKENDS`` environment variable lists (comma-separated).
        backend_options: per-backend settings; today ``{"inductor": {"mode":
            "max-autotune", "options": {...}}}`` (torch.compile's mode, Inductor's config;
            ``hybrid`` compiles with them too).
        optimize_memory: the memory optimize itself may add while it captures an input
            signature, beyond what the process holds when it starts (bytes, a fraction of the
            memory free then in (0, 1], or a string like ``"4GiB"``); None: what is free. A
            step that would need more (a packed or merged copy of weights, a backend
            candidate, eager's outputs kept between verification checks) is left out or done
            one at a time, and the report says so.
        calibration: with ``precision="int8"``: batches of inputs (an iterable of input
            tuples, or a ``DataLoader``) to calibrate static int8 on: convolutions and matrix
            multiplies run in int8 with activation scales fixed from them, by the engines'
            own quantizers (see ``autoopt.backends.static_int8``). None: int8 is dynamic,
            for linears only.
    """

    disable: tuple[str, ...] = ()
    pipeline: tuple[tuple[str, PassFn], ...] | None = None
    verify: bool = True
    debug: bool = False
    random_inputs: int = 2
    tolerances: Mapping[torch.dtype, Tolerance] = field(default_factory=dict)
    capture: tuple[str, ...] = CAPTURE_METHODS
    max_specializations: int = 8
    pass_options: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    memory_budget: int | float | str | None = None
    memory_modes: tuple[str, ...] | None = None
    # Precision casting (passes/precision.py); autoopt.options.precision checks the device.
    precision: str | None = None  # None/"fp32", "bf16", "fp16", "int8" or "int4" (CPU inference)
    tolerance: float | None = None  # end-to-end relative error allowed under ``precision``
    # Pipeline (autoopt.parallel): one stage per device, cut by measured time.
    devices: tuple[str, ...] | None = None  # e.g. ("cuda:0", "cuda:1"); None: no pipeline
    microbatches: int = 1  # each call is split into this many along the batch dimension
    # The HTML report (autoopt.diagnose.render): a path optimize writes it to, after measuring
    # and diagnosing the model before and after; None writes none.
    report: str | None = None
    cuda_graphs: bool = True
    backend: str | None = None
    backends: tuple[str, ...] | None = None
    backend_options: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    optimize_memory: int | float | str | None = None
    calibration: Any = None  # static int8's batches (autoopt.options.calibration)

    def __post_init__(self) -> None:
        # None for a collection option means none, as leaving it out does.
        for name, empty in (("disable", ()), ("capture", CAPTURE_METHODS), ("pass_options", {}),
                            ("backend_options", {})):
            if getattr(self, name) is None:
                object.__setattr__(self, name, empty)
        for name in ("pass_options", "backend_options"):
            value = getattr(self, name)
            if not isinstance(value, Mapping) or not all(
                    isinstance(v, Mapping) for v in value.values()):
                raise ConfigError(f"{name} maps a name to a dict of options, e.g. "
                                  f"{{'packed_linear': {{'measure': False}}}}; got {value!r}")
        object.__setattr__(self, "disable", tuple(self.disable))
        object.__setattr__(self, "capture", tuple(self.capture))
        if self.pipeline is not None:
            object.__setattr__(self, "pipeline", tuple(self.pipeline))
        known = {name for name, _ in self.passes}
        unknown = [n for n in self.disable if n not in known]
        if unknown:
            raise ConfigError(f"unknown pass name(s) in disable: {unknown}; "
                              f"known passes are {sorted(known)}")
        unknown_options = [n for n in self.pass_options if n not in known]
        if unknown_options:
            raise ConfigError(f"pass_options names unknown pass(es) {unknown_options}; "
                              f"known passes are {sorted(known)}")
        bad = [m for m in self.capture if m not in CAPTURE_METHODS]
        if bad or not self.capture:
            raise ConfigError(f"capture must be a non-empty list drawn from {CAPTURE_METHODS}; "
                              f"got {list(self.capture)}")
        if not isinstance(self.random_inputs, int) or self.random_inputs < 0:
            raise ConfigError(f"random_inputs must be an integer >= 0; got {self.random_inputs!r}")
        if not isinstance(self.max_specializations, int) or self.max_specializations < 1:
            raise ConfigError("max_specializations must be an integer >= 1; "
                              f"got {self.max_specializations!r}")
        for dtype, tol in self.tolerances.items():
            if not isinstance(dtype, torch.dtype) or not isinstance(tol, Tolerance):
                raise ConfigError("tolerances maps torch.dtype to autoopt.Tolerance; "
                                  f"got {dtype!r}: {tol!r}")
        if self.memory_budget is not None:
            parse_budget(self.memory_budget)
        if self.memory_modes is not None:
            object.__setattr__(self, "memory_modes", parse_modes(self.memory_modes))
        if self.optimize_memory is not None:
            parse_budget(self.optimize_memory, "optimize_memory", "the memory free")
        _check_devices(self)
        if self.report is not None and not isinstance(self.report, str):
            if not hasattr(self.report, "__fspath__"):
                raise ConfigError(f"report is a path for the HTML report, e.g. "
                                  f"report='report.html'; got {self.report!r}")
            object.__setattr__(self, "report", str(self.report))
        _check_precision(self.precision, self.tolerance)
        _check_backends(self)
        _check_calibration(self)

    @property
    def passes(self) -> tuple[tuple[str, PassFn], ...]:
        return PIPELINE if self.pipeline is None else self.pipeline

    # What the options imply, derived when read (the config itself stays as the user gave it).

    @property
    def low_precision(self) -> bool:
        return self.precision not in (None, "fp32")

    @property
    def precision_tolerance(self) -> float | None:
        """The end-to-end relative error allowed under ``precision`` (None in fp32)."""
        if not self.low_precision:
            return None
        return float(self.tolerance) if self.tolerance is not None else DEFAULT_TOLERANCE[
            self.precision]

    @property
    def resolved_pass_options(self) -> dict[str, dict[str, Any]]:
        """Each pass's options: the user's, and for the precision pass the precision and its
        tolerance."""
        options = {name: dict(opts) for name, opts in self.pass_options.items()}
        if self.calibration is not None:  # static int8: the engines quantize, not the pass
            options.setdefault("precision", {}).update(precision=None)
        elif self.low_precision:
            options.setdefault("precision", {}).update(precision=self.precision,
                                                       tolerance=self.precision_tolerance)
        return options

    @property
    def disabled_passes(self) -> tuple[str, ...]:
        """The passes not to run: the user's, and under static int8 the lowerings onto
        autoopt's own kernels, which the engines that quantize never run."""
        if self.calibration is None:
            return self.disable
        return tuple(dict.fromkeys((*self.disable, *sorted(LOWERING))))

    @property
    def optimize_memory_limit(self) -> int | float | None:
        """``optimize_memory`` in bytes, or as the fraction of free memory; None: no limit
        beyond what is free."""
        if self.optimize_memory is None:
            return None
        return parse_budget(self.optimize_memory, "optimize_memory", "the memory free")

    @property
    def candidate_backends(self) -> tuple[str, ...]:
        """The backends to choose from, in order of preference on a tie (pipeline stages,
        ``devices=``, run the aten graph)."""
        if self.devices is not None:
            return ("aten",)
        if self.backend is not None:
            return (self.backend,)
        if self.backends is not None:
            return self.backends
        return _parse_backends(os.environ.get(BACKENDS_VARIABLE, ""), BACKENDS_VARIABLE) \
            or BACKENDS

    @property
    def verification_tolerances(self) -> dict[torch.dtype, Tolerance]:
        """Per-dtype tolerances for verification: the user's; under ``precision`` fp32
        outputs may differ by the precision's tolerance (``|error| <= tolerance *
        max(1, max|out|)``) unless the user set fp32's."""
        tolerances = dict(self.tolerances)
        if self.low_precision:
            tolerances.setdefault(torch.float32, Tolerance(rtol=0.0,
                                                           atol=self.precision_tolerance))
        return tolerances

    @classmethod
    def build(cls, config: OptimizeConfig | Mapping[str, Any] | None,
              overrides: Mapping[str, Any]) -> OptimizeConfig:
        """Merge ``config`` (an instance, a dict or None) with keyword overrides, checking
        every key."""
        if config is None:
            base: dict[str, Any] = {}
        elif isinstance(config, OptimizeConfig):
            base = {f.name: getattr(config, f.name) for f in dataclasses.fields(cls)}
        elif isinstance(config, Mapping):
            base = dict(config)
        else:
            raise ConfigError(f"config must be an OptimizeConfig or a dict; got "
                              f"{type(config).__name__}")
        base.update(overrides)
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(base) - names)
        if unknown:
            raise ConfigError(f"unknown option(s) {unknown}; valid options are {sorted(names)}")
        if isinstance(base.get("disable"), str):
            base["disable"] = (base["disable"],)
        return cls(**base)


def _check_precision(precision: Any, tolerance: Any) -> None:
    if precision is not None and precision not in PRECISIONS:
        raise ConfigError(f"precision={precision!r} is not supported; use one of "
                          f"{[None, *PRECISIONS]}")
    if tolerance is not None:
        if isinstance(tolerance, bool) or not isinstance(tolerance, (int, float)) or not (
                0 < tolerance < 1):
            raise ConfigError(f"tolerance must be a number in (0, 1), the end-to-end relative "
                              f"error allowed; got {tolerance!r}")
        if precision in (None, "fp32"):
            raise ConfigError(f"tolerance={tolerance!r} is the error allowed under reduced "
                              f"precision; pass precision='bf16', 'fp16', 'int8' or 'int4' with it")


def _check_calibration(config: OptimizeConfig) -> None:
    if config.calibration is None:
        return
    if config.precision != "int8":
        raise ConfigError(f"calibration= gives static int8 its activation ranges; pass "
                          f"precision='int8' with it (got precision={config.precision!r})")
    if config.devices is not None:
        raise ConfigError("calibration= (static int8) runs on one CPU engine; it cannot be "
                          "combined with devices= (pipeline stages run on aten)")
    object.__setattr__(config, "calibration", calibration(config.calibration))
    if not set(config.candidate_backends) & set(STATIC_INT8):
        raise ConfigError(f"precision='int8' with calibration= runs on "
                          f"{' or '.join(STATIC_INT8)}, and the backends allowed here are "
                          f"{list(config.candidate_backends)}: name one of them in backends= "
                          f"(or in {BACKENDS_VARIABLE})")


def _check_backends(config: OptimizeConfig) -> None:
    if config.backend is not None and config.backends is not None:
        raise ConfigError(f"pass backend= (one backend, required) or backends= (candidates to "
                          f"measure), not both; got backend={config.backend!r}, "
                          f"backends={config.backends!r}")
    if config.backend is not None:
        if config.backend not in BACKENDS:
            raise ConfigError(f"backend={config.backend!r} is not a backend; use one of "
                              f"{BACKENDS} (or None to measure them)")
    if config.backends is not None:
        names = (config.backends,) if isinstance(config.backends, str) else config.backends
        object.__setattr__(config, "backends", _parse_backends(",".join(names), "backends"))
        if not config.backends:
            raise ConfigError(f"backends is empty; name at least one of {BACKENDS}")
    _parse_backends(os.environ.get(BACKENDS_VARIABLE, ""), BACKENDS_VARIABLE)
    settable = {"inductor": INDUCTOR_OPTIONS}
    for name, settings in dict(config.backend_options).items():
        if name not in settable or not isinstance(settings, Mapping) or set(settings) - set(
                settable[name]):
            raise ConfigError(f"backend_options={dict(config.backend_options)!r}: settable are "
                              f"{ {k: list(v) for k, v in settable.items()} } (e.g. "
                              f"backend_options={{'inductor': {{'mode': 'max-autotune'}}}})")
    asked = (config.backend,) if config.backend is not None else config.backends or ()
    if config.devices is not None and set(asked) - {"aten"}:
        raise ConfigError(f"devices= runs each pipeline stage on aten (the graph's own "
                          f"kernels); backend(s) {sorted(set(asked) - {'aten'})} cannot "
                          f"execute stages. Drop backend=/backends= or pass backends=('aten',).")


def _parse_backends(text: str, where: str) -> tuple[str, ...]:
    names = tuple(dict.fromkeys(n.strip() for n in text.split(",") if n.strip()))
    unknown = [n for n in names if n not in BACKENDS]
    if unknown:
        raise ConfigError(f"{where} names unknown backend(s) {unknown}; the backends are "
                          f"{BACKENDS}")
    return names


def _check_devices(config: OptimizeConfig) -> None:
    """``devices`` names real devices, at least one; ``microbatches`` is a positive int."""
    if not isinstance(config.microbatches, int) or config.microbatches < 1:
        raise ConfigError(f"microbatches must be an integer >= 1; got {config.microbatches!r}")
    if config.devices is None:
        return
    if isinstance(config.devices, str):
        object.__setattr__(config, "devices", (config.devices,))
    devices = tuple(str(d) for d in config.devices)
    object.__setattr__(config, "devices", devices)
    if not devices:
        raise ConfigError("devices is empty; list one device per pipeline stage, e.g. "
                          "devices=['cuda:0', 'cuda:1'] (or ['cpu', 'cpu'] to test).")
    for name in devices:
        try:
            device = torch.device(name)
        except (RuntimeError, TypeError) as exc:
            raise ConfigError(f"devices: {name!r} is not a device name; use 'cpu' or "
                              f"'cuda:N'.") from exc
        if device.type not in ("cpu", "cuda"):
            raise ConfigError(f"devices: {name!r} is a {device.type} device; pipelines run on "
                              f"'cpu' and 'cuda:N' devices.")
        if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
            raise ConfigError(f"devices: {name!r} does not exist here ({torch.cuda.device_count()}"
                              f" CUDA device(s)); list devices this machine has.")


