"""The options of ``autoopt.optimize``, with their meaning and checks."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from .errors import ConfigError
from .passes import PIPELINE, PassFn
from .verify import Tolerance

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
        cuda_graphs: on a CUDA device, replay each static-shape inference graph as one CUDA
            graph (one launch per call instead of one per kernel); checked against eager too.
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
    cuda_graphs: bool = True

    def __post_init__(self) -> None:
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

    @property
    def passes(self) -> tuple[tuple[str, PassFn], ...]:
        return PIPELINE if self.pipeline is None else self.pipeline

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


