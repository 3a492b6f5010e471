"""Whether the ``precision=`` option can work on the target device and gains anything there,
and the error when it did not apply to any op.

The options are checked, and what they imply derived, by ``OptimizeConfig``; the casting
itself is the ``precision`` pass (``passes/precision.py``).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch.utils import _pytree as pytree

from autoopt.cost_model.dtype_speed import matmul_flops
from autoopt.errors import ConfigError
from autoopt.passes.packed_kernels import fbgemm_engine
from autoopt.passes.precision import (
    DECODE_DECIDES,
    DECODER_TOLERANCE,
    DEFAULT_TRAINING_TOLERANCE,
    LOW_DTYPES,
)
from autoopt.passes.precision_int8 import KERNELS
from autoopt.passes.weight_only import GROUPS

if TYPE_CHECKING:
    from autoopt.check.report import Report
    from autoopt.options.config import OptimizeConfig

log = logging.getLogger(__name__)


def check_target(cfg: OptimizeConfig, device: torch.device | None, training: bool,
                 model: torch.nn.Module | None = None) -> OptimizeConfig:
    """Reject precision settings that cannot work on ``device``, or that would make the
    model slower than fp32 there: a module that runs fp32 beside a warning is not an answer
    to ``precision=`` (the house rule: a requested feature applies or raises).

    ``pass_options={"precision": {"force": True}}`` casts even where it measures slower.

    bf16 for a model that generates (or one of its step graphs) on a CPU whose bf16 GEMM is
    slower than fp32's runs as fp16-weight linears instead (the precision pass's
    ``weight_only`` option): a decode step reads half the bytes with no cast, and each linear
    is measured against fp32's kernels, as int8's are.

    In training without a ``tolerance`` of the user's, verification allows what the field's
    mixed precision errs by (``DEFAULT_TRAINING_TOLERANCE``), not the inference default.

    Returns:
        The config to use.
    """
    precision = cfg.precision
    if precision in (None, "fp32") or "precision" in cfg.disable:
        return cfg
    device = device or torch.device("cpu")
    options = cfg.pass_options.get("precision", {})
    force = bool(options.get("force", False))
    if options.get("weight_only") and (precision != "bf16" or device.type != "cpu" or training):
        raise ConfigError("pass_options={'precision': {'weight_only': True}} is bf16 inference "
                          "on the CPU (fp16-weight linears); drop it here")
    if precision in KERNELS:  # int8, int4
        _check_quantized_options(precision, options)
        if training:
            raise ConfigError(f"precision='{precision}' is for inference: quantized linears "
                              f"have no gradient. Use precision='bf16' (or 'fp16' on a GPU) for "
                              f"training, or optimize with training=False.")
        if device.type != "cpu":
            what = "dynamic quantization" if precision == "int8" else "weight-only int4"
            raise ConfigError(f"precision='{precision}' ({what}) runs on the CPU only; "
                              f"the model is on {device}: its kernels are CPU ones. Use "
                              f"precision='fp16' or 'bf16' there.")
        return cfg
    _check_min_agreement(cfg.pass_options.get("precision", {}))
    dtype = LOW_DTYPES[precision]
    if training and cfg.tolerance is None:
        cfg = dataclasses.replace(cfg, tolerance=DEFAULT_TRAINING_TOLERANCE[precision])
    if device.type == "cuda":
        if dtype == torch.bfloat16 and not torch.cuda.is_bf16_supported():
            raise ConfigError(f"precision='bf16' but {torch.cuda.get_device_name(device)} has "
                              f"no bf16 support; use precision='fp16'.")
        return cfg
    if options.get("weight_only"):
        return cfg
    fp32, low = matmul_flops(device, torch.float32), matmul_flops(device, dtype)
    if low > fp32 or force:
        return cfg
    if dtype == torch.bfloat16 and not training and model is not None and generates(model) \
            and fbgemm_engine() is not None:
        log.info("precision bf16: no fast bf16 GEMM here (%.0f GFLOP/s against fp32's %.0f): "
                 "linears hold fp16 weights where that measures faster", low / 1e9, fp32 / 1e9)
        return dataclasses.replace(cfg, pass_options={
            **cfg.pass_options, "precision": {**options, "weight_only": True}})
    speed = f"{low / 1e9:.0f} GFLOP/s in {precision} vs {fp32 / 1e9:.0f} in fp32 (measured)"
    other = "Use precision='bf16' or 'int8' here, " if precision == "fp16" else \
        "Drop precision= (fp32 is the faster here), use precision='int8', "
    raise ConfigError(f"precision='{precision}' on this CPU would be slower than fp32 "
                      f"({speed}): it has no fast {precision} matmul. {other}or pass "
                      f"pass_options={{'precision': {{'force': True}}}} to cast anyway.")


def _check_quantized_options(precision: str, options: Mapping[str, Any]) -> None:
    """The precision pass's int8/int4 options: ``kernel``, ``group_size``, ``min_agreement``."""
    kernel = options.get("kernel")
    if kernel is not None and kernel not in KERNELS[precision]:
        raise ConfigError(f"pass_options={{'precision': {{'kernel': {kernel!r}}}}} is not a "
                          f"{precision} kernel; use one of {list(KERNELS[precision])}, or leave "
                          f"it out to choose by measurement")
    group = options.get("group_size")
    if group is not None and group not in GROUPS:
        raise ConfigError(f"pass_options={{'precision': {{'group_size': {group!r}}}}}: int4's "
                          f"group size is one of {list(GROUPS)}")
    _check_min_agreement(options)


def _check_min_agreement(options: Mapping[str, Any]) -> None:
    least = options.get("min_agreement")
    if least is not None and (isinstance(least, bool) or not isinstance(least, (int, float))
                              or not 0 <= least <= 1):
        raise ConfigError(f"pass_options={{'precision': {{'min_agreement': {least!r}}}}}: the "
                          f"next-token agreement required is a number in [0, 1] (0 accepts "
                          f"any)")


def autocast_tolerance(cfg: OptimizeConfig, model: torch.nn.Module, args: tuple[Any, ...],
                       kwargs: Mapping[str, Any], training: bool) -> OptimizeConfig:
    """In training under the default tolerance, allow twice what ``torch.autocast`` itself
    errs by on the example inputs, where that is more than the default.

    Training precision follows autocast's practice (``passes/precision_policy.py``), so
    verification's yardstick is autocast's own error on this model, not one figure for every
    model: a train-mode resnet50 under autocast errs 9.8% against fp32 on two images (12% on
    eight), past the 8% default, and the default alone rolled back casts as exact as
    autocast's. Twice, as the precision pass's example inputs may use half the tolerance:
    fresh inputs verified later may err more. A tolerance of the user's is kept as given.
    """
    low = LOW_DTYPES.get(cfg.precision or "")
    if not training or low is None or cfg.tolerance is not None or "precision" in cfg.disable:
        return cfg
    from autoopt.cost_model.isolation import preserved

    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    try:
        with torch.no_grad():
            with preserved(model, (args, kwargs)):  # the same RNG and statistics for both
                reference = model(*args, **kwargs)
            with preserved(model, (args, kwargs)), torch.autocast(device.type, low):
                autocast = model(*args, **kwargs)
    except Exception as exc:  # noqa: BLE001 - verification will say what fails; keep default
        log.info("precision: autocast's own error not measured: %s: %s", type(exc).__name__,
                 exc)
        return cfg
    error = 0.0
    for ref, out in zip(pytree.tree_leaves(reference), pytree.tree_leaves(autocast),
                        strict=False):
        if isinstance(ref, torch.Tensor) and ref.is_floating_point() and ref.numel() \
                and isinstance(out, torch.Tensor) and out.shape == ref.shape:
            scale = max(1.0, ref.abs().max().item())
            error = max(error, (out.float() - ref.float()).abs().max().item() / scale)
    if 2 * error <= DEFAULT_TRAINING_TOLERANCE[cfg.precision or ""]:
        return cfg  # check_target sets the default
    log.info("precision %s: autocast itself errs %.3g on the example inputs: tolerance %.3g",
             cfg.precision, error, 2 * error)
    return dataclasses.replace(cfg, tolerance=2 * error)


def decoder_tolerance(cfg: OptimizeConfig, model: torch.nn.Module, training: bool,
                      ) -> OptimizeConfig:
    """For inference of a model that generates, under a tolerance not the user's: the
    decoder's (``DECODER_TOLERANCE``), its next-token agreement (``MIN_AGREEMENT``) judging
    the precision. The step graphs ``generate`` builds take the same config."""
    if training or cfg.tolerance is not None or "precision" in cfg.disable \
            or cfg.precision not in DECODER_TOLERANCE or not decodes_elsewhere(model):
        return cfg
    return dataclasses.replace(cfg, tolerance=DECODER_TOLERANCE[cfg.precision])


def check_applied(cfg: OptimizeConfig, report: Report, module: torch.nn.Module | None = None,
                  ) -> None:
    """Raise where ``precision=`` was asked for but no captured graph runs in it: the
    measurement or the tolerance decided against every op, or the capture cannot take it.

    A decoder (``module`` generates, or is a prompt step of one) whose graph int8/int4
    measured slower on at its many rows per weight, but whose quality agreed, runs that graph
    in fp32: its decode steps measure for themselves, and the first ``generate`` raises where
    they run no faster either."""
    if cfg.precision in (None, "fp32") or "precision" in cfg.disable:
        return
    static = cfg.calibration is not None  # every export graph's engine quantized, or raised
    if not static and any(c.precision is not None for c in report.captures):
        return
    why = {r.reason for c in report.captures for r in c.passes
           if r.name == "precision" and r.reason}
    if why and all(DECODE_DECIDES in w for w in why) and decodes_elsewhere(module):
        return
    methods = {c.method for c in report.captures}
    if static and not methods - {"export"}:
        return
    if methods - {"export"}:
        attempts = "; ".join(f"{m}: {w}" for c in report.captures for m, w in c.attempts)
        raise ConfigError(f"precision='{cfg.precision}' cannot apply: the model was captured by "
                          f"{sorted(methods)}, and the precision pass works on torch.export "
                          f"graphs only (why not export: {attempts or 'not tried'}). Make the "
                          f"model exportable (no data-dependent control flow, no hooks, no "
                          f"Python state changed on every call), or drop precision=.")
    if why:
        reason = "; ".join(sorted(why))
    else:
        reason = (f"no compute-heavy op could run in {cfg.precision} within the tolerance "
                  f"{cfg.precision_tolerance:g} (inference), or no op, or not the whole "
                  f"training step with its casts, measured faster than fp32 (training)")
    if "next-token agreement" in reason:  # the reason says what to pass instead
        raise ConfigError(f"precision='{cfg.precision}' refused for this model: {reason}.")
    if "drop precision=" in reason:  # the one reason that applied, with what to do: no other
        raise ConfigError(f"precision='{cfg.precision}' cannot apply to this model: {reason}.")
    # The pass's own reason may give the force hint already (int8 measured slower): once; and
    # none to a caller who passed it.
    forced = bool(cfg.pass_options.get("precision", {}).get("force", False))
    force = ("" if "'force'" in reason or forced else
             ", or pass_options={'precision': {'force': True}} to cast where it measures "
             "slower")
    raise ConfigError(f"precision='{cfg.precision}' cannot apply to this model: {reason}. It "
                      f"would run in fp32: drop precision= for that"
                      + (", or" if not force else ",")
                      + f" pass a larger tolerance= where the error decided{force}.")


# Set on a generator's prompt-step module: its decode steps decide whether a precision applies.
PROMPT_STEP = "autoopt_prompt_step"


def generates(module: torch.nn.Module) -> bool:
    """Whether ``module`` is a model with transformers' ``generate``, or one of its step graphs
    (``generate``'s prompt and decode steps)."""
    return callable(getattr(module, "generate", None)) or hasattr(module, PROMPT_STEP)


def decodes_elsewhere(module: torch.nn.Module | None) -> bool:
    """Whether ``module``'s graphs are not the ones a decoder's precision is judged by: a
    model with transformers' ``generate`` (its decode steps are), or a prompt step of one."""
    return module is not None and (callable(getattr(module, "generate", None))
                                   or bool(getattr(module, PROMPT_STEP, False)))


def export_config(config: OptimizeConfig | Mapping[str, Any] | None, precision: str | None,
                  ) -> OptimizeConfig | Mapping[str, Any] | None:
    """The optimize config for ``export_onnx(..., precision=p)``: the ONNX runtime, not this
    CPU, runs the graph, so the casts are made even where PyTorch here would be slower."""
    from autoopt.options.config import OptimizeConfig

    if precision is None:
        return config
    cfg = OptimizeConfig.build(config, {})
    options = dict(cfg.pass_options)
    options["precision"] = {**options.get("precision", {}), "force": True}
    return OptimizeConfig.build(cfg, {"precision": precision, "pass_options": options})
