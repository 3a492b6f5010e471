"""The ``precision=`` and ``tolerance=`` options: their checks, what verification then allows,
and whether the target device gains from the low precision at all.

The casting itself is the ``precision`` pass (``passes/precision.py``); this module only
decides whether it may run and hands it its settings.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from .cost_model.precision import matmul_flops
from .errors import ConfigError
from .passes.precision import DEFAULT_TOLERANCE, LOW_DTYPES, PRECISIONS
from .verify import Tolerance

if TYPE_CHECKING:
    from .config import OptimizeConfig
    from .report import Report

log = logging.getLogger(__name__)


def configure(cfg: OptimizeConfig) -> None:
    """Check ``cfg.precision``/``cfg.tolerance``; give the pass its options and make fp32
    outputs verify against the user's tolerance (``|error| <= tolerance * max(1, max|out|)``).
    """
    precision, tolerance = cfg.precision, cfg.tolerance
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
                              f"precision; pass precision='bf16', 'fp16' or 'int8' with it")
    # A config rebuilt from one that had a precision: forget what configure set there before.
    options = dict(cfg.pass_options)
    mine = dict(options.get("precision", {}))
    mine.pop("precision", None)
    previous = mine.pop("tolerance", None)
    tolerances = dict(cfg.tolerances)
    if previous is not None and tolerances.get(torch.float32) == Tolerance(0.0, previous):
        del tolerances[torch.float32]
    if precision not in (None, "fp32"):
        tolerance = float(tolerance) if tolerance is not None else DEFAULT_TOLERANCE[precision]
        mine.update(precision=precision, tolerance=tolerance)
        tolerances.setdefault(torch.float32, Tolerance(rtol=0.0, atol=tolerance))
    if mine:
        options["precision"] = mine
    else:
        options.pop("precision", None)
    object.__setattr__(cfg, "pass_options", options)
    object.__setattr__(cfg, "tolerances", tolerances)


def check_target(cfg: OptimizeConfig, device: torch.device | None, training: bool,
                 ) -> tuple[OptimizeConfig, list[str]]:
    """Reject precision settings that cannot work on ``device``; turn the pass off (with a
    note for the report) where the low precision would be slower than fp32.

    ``pass_options={"precision": {"force": True}}`` casts even where it measures slower.

    Returns:
        The config to use and the notes for the report.
    """
    precision = cfg.precision
    if precision in (None, "fp32") or "precision" in cfg.disable:
        return cfg, []
    device = device or torch.device("cpu")
    force = bool(cfg.pass_options.get("precision", {}).get("force", False))
    if precision == "int8":
        if training:
            raise ConfigError("precision='int8' is for inference: quantized linears have no "
                              "gradient. Use precision='bf16' (or 'fp16' on a GPU) for "
                              "training, or optimize with training=False.")
        if device.type != "cpu":
            raise ConfigError(f"precision='int8' (dynamic quantization) runs on the CPU only; "
                              f"the model is on {device}. Use precision='fp16' or 'bf16' there.")
        return cfg, []
    dtype = LOW_DTYPES[precision]
    if device.type == "cuda":
        if dtype == torch.bfloat16 and not torch.cuda.is_bf16_supported():
            raise ConfigError(f"precision='bf16' but {torch.cuda.get_device_name(device)} has "
                              f"no bf16 support; use precision='fp16'.")
        return cfg, []
    fp32, low = matmul_flops(device, torch.float32), matmul_flops(device, dtype)
    if low > fp32 or force:
        return cfg, []
    speed = f"{low / 1e9:.0f} GFLOP/s in {precision} vs {fp32 / 1e9:.0f} in fp32 (measured)"
    if precision == "fp16":
        raise ConfigError(f"precision='fp16' on this CPU would be slower than fp32 ({speed}); "
                          f"use precision='bf16' or 'int8' here, or pass "
                          f"pass_options={{'precision': {{'force': True}}}} to cast anyway.")
    note = (f"precision='{precision}' not applied: this CPU has no fast {precision} matmul "
            f"({speed}); the model runs in fp32. pass_options={{'precision': {{'force': "
            f"True}}}} casts anyway.")
    log.warning("%s", note)
    return dataclasses.replace(cfg, disable=(*cfg.disable, "precision")), [note]


def notes_after(cfg: OptimizeConfig, report: Report) -> list[str]:
    """A report note when ``precision=`` was asked for but no captured graph runs in it."""
    if cfg.precision in (None, "fp32") or "precision" in cfg.disable:
        return []
    if any(c.precision is not None for c in report.captures):
        return []
    why = {r.reason for c in report.captures for r in c.passes
           if r.name == "precision" and r.reason}
    methods = {c.method for c in report.captures}
    if methods - {"export"}:
        reason = (f"the model was captured by {sorted(methods)}, and the precision pass works "
                  f"on torch.export graphs only; make the model exportable (for transformers, "
                  f"use_cache=False often suffices)")
    elif why:
        reason = "; ".join(sorted(why))
    else:
        reason = (f"no compute-heavy op could run in {cfg.precision} within the tolerance "
                  f"{cfg.pass_options['precision']['tolerance']:g}")
    return [f"precision='{cfg.precision}' not applied: {reason}; the model runs in fp32"]


def export_config(config: OptimizeConfig | Mapping[str, Any] | None, precision: str | None,
                  ) -> OptimizeConfig | Mapping[str, Any] | None:
    """The optimize config for ``export_onnx(..., precision=p)``: the ONNX runtime, not this
    CPU, runs the graph, so the casts are made even where PyTorch here would be slower."""
    from .config import OptimizeConfig

    if precision is None:
        return config
    cfg = OptimizeConfig.build(config, {})
    options = dict(cfg.pass_options)
    options["precision"] = {**options.get("precision", {}), "force": True}
    return OptimizeConfig.build(cfg, {"precision": precision, "pass_options": options})
