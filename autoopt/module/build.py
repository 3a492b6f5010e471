"""From the user's call to an ``OptimizedModule`` ready to capture: inputs checked, the model
copied (never modified), devices and dtypes checked, the precision option checked against the
target. ``build`` then captures the example call; ``autoopt.optimize`` adds the features on
top (pipelines, the HTML report), and ``Diagnosis.apply`` uses ``build`` directly.
"""

from __future__ import annotations

import contextlib
import copy
import warnings
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from autoopt.check.inputs import clone_inputs
from autoopt.check.state import own_buffers, preserved
from autoopt.compile.compiled import EagerRaised, model_device
from autoopt.errors import ConfigError, DeviceError, InputError, ModelError
from autoopt.module.optimized import OptimizedModule
from autoopt.options import precision as precision_lib
from autoopt.options.config import OptimizeConfig


def prepare(model: nn.Module, example_inputs: Any, example_kwargs: Mapping[str, Any] | None,
            cfg: OptimizeConfig, *, device: str | torch.device | None = None,
            dynamic: bool | None = None, dynamic_shapes: Any = None,
            training: bool | None = None,
            module_class: type[OptimizedModule] = OptimizedModule,
            ) -> tuple[OptimizedModule, tuple[Any, ...], dict[str, Any], bool]:
    """The core module for ``model`` (not yet captured), the example inputs on its device,
    and whether the example call is a training step. See ``autoopt.optimize`` for the
    arguments; ``module_class`` is the ``OptimizedModule`` (sub)class to make (a feature
    layered on the core, such as ``generate``, brings its own)."""
    model = unwrap(model)
    args, kwargs = check_inputs(example_inputs, example_kwargs)
    target = _resolve_device(model, device)
    training = model.training if training is None else training
    # An inference module reads your weights where they are (no second copy in memory) until
    # something would write them: it takes its own copy then (OptimizedModule._unshare).
    share = not training and cfg.devices is None and (target is None
                                                      or target == model_device(model))
    try:
        private = _private_copy(model, share_weights=share)
    except Exception as exc:
        raise ModelError(f"autoopt needs a private copy of the model (it never modifies yours), "
                         f"but copy.deepcopy failed: {type(exc).__name__}: {exc}. Make the "
                         f"module deep-copyable (no open files, locks or generators as "
                         f"attributes).") from exc
    if target is not None:
        private.to(target)
        args, kwargs = pytree.tree_map_only(torch.Tensor, lambda t: t.to(target), (args, kwargs))
    _check_devices_and_dtypes(private, args, kwargs)
    if cfg.calibration is not None:
        cfg.calibration.check(args, kwargs, private.forward)
    # precision=: reject what cannot work on this device, or would be slower there.
    cfg = precision_lib.autocast_tolerance(cfg, private, args, kwargs, training)
    cfg = precision_lib.decoder_tolerance(cfg, private, training)
    cfg = precision_lib.check_target(cfg, model_device(private), training, private)
    optimized = module_class(private, cfg, dynamic=dynamic, dynamic_shapes=dynamic_shapes,
                             shares_weights=share)
    if cfg.memory_budget is not None and not training:
        raise ConfigError("memory_budget limits the activations saved for a training step; "
                          "pass training=True (or a model in train mode), or drop "
                          "memory_budget for inference.")
    return optimized, args, kwargs, training


def build(model: nn.Module, example_inputs: Any = (),
          example_kwargs: Mapping[str, Any] | None = None, *,
          device: str | torch.device | None = None,
          config: OptimizeConfig | Mapping[str, Any] | None = None, dynamic: bool | None = None,
          dynamic_shapes: Any = None, training: bool | None = None, **options: Any,
          ) -> OptimizedModule:
    """``autoopt.optimize`` without the features layered on the core (``devices=``,
    ``report=``): the core module with the example call captured."""
    cfg = OptimizeConfig.build(config, options)
    if cfg.devices is not None or cfg.report is not None:
        raise ConfigError("build() makes the core module; pass devices= or report= to "
                          "autoopt.optimize")
    optimized, args, kwargs, training = prepare(model, example_inputs, example_kwargs, cfg,
                                                device=device, dynamic=dynamic,
                                                dynamic_shapes=dynamic_shapes,
                                                training=training)
    return capture_example(optimized, args, kwargs, training)


def capture_example(optimized: OptimizedModule, args: tuple[Any, ...],
                    kwargs: dict[str, Any], training: bool) -> OptimizedModule:
    """Capture the example call (in its grad mode); raise where ``precision=`` applied to
    no op."""
    with torch.no_grad() if not training else contextlib.nullcontext():
        try:
            optimized.specialize(args, kwargs)
        except EagerRaised as exc:
            raise _raised_on_example(exc.original) from exc.original
    precision_lib.check_applied(optimized.config, optimized.report, optimized.module)
    return optimized


def defer_example(optimized: OptimizedModule, args: tuple[Any, ...],
                  kwargs: dict[str, Any]) -> OptimizedModule:
    """Run the example call eagerly, as a check of the inputs, and leave its graph to the
    first forward call (``optimized.report.deferred`` says so).

    For an inference model whose ``generate`` builds its own prompt and decode step graphs:
    the forward graph built now (capture, passes, verification, the backend choice: 16-45 s
    for a 100M-parameter decoder on one core) would be work that decoding never uses. A
    forward call builds it as it builds any new input signature's graph, ``precision=``
    checked there as here."""
    module = optimized.module
    device = model_device(module)
    cuda = [device.index or 0] if device is not None and device.type == "cuda" else []
    # On copies of the buffers and inputs, Python state and the RNG put back: the module
    # may share memory with your model, and the capture's own probe sees a first call.
    with torch.no_grad(), own_buffers(module), preserved(module), \
            torch.random.fork_rng(devices=cuda):
        probe_args, probe_kwargs = clone_inputs(args, kwargs)
        try:
            module(*probe_args, **probe_kwargs)
        except Exception as exc:
            raise _raised_on_example(exc) from exc
    optimized.report.deferred = (
        "the example call's graph is built at the first forward call (fast(...)); "
        "generate builds and verifies its own prompt and decode step graphs, so none is "
        "built for the forward until it is called. The example inputs ran eagerly, as a check")
    return optimized


def _raised_on_example(exc: BaseException) -> ModelError:
    return ModelError(f"the model raised {type(exc).__name__} when run eagerly on the example "
                      f"inputs: {exc}. Check the inputs' number, shapes and dtypes against the "
                      f"model's forward.")


def unwrap(model: Any) -> nn.Module:
    if isinstance(model, OptimizedModule):
        return model.module
    original = getattr(model, "_orig_mod", None)  # torch.compile's wrapper
    if isinstance(original, nn.Module):
        return original
    if not isinstance(model, nn.Module):
        raise ModelError(f"optimize expects a torch.nn.Module; got {type(model).__name__}. "
                         "Wrap a function in an nn.Module whose forward calls it.")
    if isinstance(model, torch.jit.ScriptModule):
        raise ModelError("TorchScript modules cannot be captured; pass the original Python "
                         "nn.Module instead of the torch.jit.script/trace result.")
    meta = [n for n, p in model.named_parameters() if p.is_meta]
    if meta:
        raise ModelError(f"parameters on the meta device have no values ({meta[0]}, ...); "
                         "load or initialise the weights (e.g. model.to_empty(device=...) "
                         "then load_state_dict) before optimizing.")
    return model


def check_inputs(example_inputs: Any, example_kwargs: Mapping[str, Any] | None,
                  ) -> tuple[tuple[Any, ...], dict[str, Any]]:
    if isinstance(example_inputs, torch.Tensor):
        example_inputs = (example_inputs,)
    if isinstance(example_inputs, Mapping):
        raise InputError("example_inputs is a dict; pass keyword inputs as example_kwargs="
                         "{...} and positional ones as a tuple.")
    if not isinstance(example_inputs, tuple):
        hint = (" If the model's first argument is a list, pass (your_list,)."
                if isinstance(example_inputs, list) else "")
        raise InputError(f"example_inputs must be a tuple of positional arguments (or one "
                         f"tensor); got {type(example_inputs).__name__}.{hint}")
    if example_kwargs is None:
        example_kwargs = {}
    if not isinstance(example_kwargs, Mapping) or not all(isinstance(k, str)
                                                          for k in example_kwargs):
        raise InputError(f"example_kwargs must be a dict from argument name to value; got "
                         f"{type(example_kwargs).__name__}.")
    leaves = [x for x in pytree.tree_leaves((example_inputs, dict(example_kwargs)))
              if isinstance(x, torch.Tensor) and x.is_floating_point()]
    if any(not bool(torch.isfinite(x).all()) for x in leaves if not x.is_meta):
        warnings.warn("autoopt: example inputs contain NaN or Inf; verification cannot judge "
                      "outputs computed from them. Pass finite example inputs.", stacklevel=3)
    return example_inputs, dict(example_kwargs)


def _private_copy(model: nn.Module, share_weights: bool) -> nn.Module:
    """A deep copy of ``model``: its own modules and Python state; with ``share_weights`` its
    parameters and buffers are new tensors on the same memory as the model's (and the same
    version counters, so the model's in-place writes are seen) instead of copies."""
    memo: dict[int, Any] = {}
    if share_weights:
        for t in (*model.parameters(), *model.buffers()):
            if t.is_inference():
                continue  # made under inference_mode: only a copy can be used outside it
            if type(t) is nn.Parameter:
                memo[id(t)] = nn.Parameter(t.detach(), requires_grad=t.requires_grad)
            elif type(t) is torch.Tensor:
                memo[id(t)] = t.detach()
            # Other tensor types (lazy or quantized parameters, subclasses) are copied.
    return copy.deepcopy(model, memo)


def _resolve_device(model: nn.Module, device: str | torch.device | None) -> torch.device | None:
    if device is None:
        return None
    try:
        target = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise DeviceError(f"device={device!r} is not a device name; use 'cpu', 'cuda' or "
                          f"'cuda:N'.") from exc
    if target.type == "cuda":
        if not torch.cuda.is_available():
            raise DeviceError(f"device={device!r} asks for CUDA but no CUDA GPU is available "
                              f"(torch.cuda.is_available() is False); use device='cpu'.")
        if target.index is not None and target.index >= torch.cuda.device_count():
            raise DeviceError(f"device={device!r} but only {torch.cuda.device_count()} CUDA "
                              f"device(s) exist.")
    return target


def _check_devices_and_dtypes(model: nn.Module, args: tuple[Any, ...],
                              kwargs: dict[str, Any]) -> None:
    device = model_device(model)
    float_dtypes = {p.dtype for p in model.parameters() if p.is_floating_point()}
    flat, _ = pytree.tree_flatten_with_path((args, kwargs))
    for path, value in flat:
        if not isinstance(value, torch.Tensor):
            continue
        where = _input_name(path)
        if device is not None and value.device != device and value.dim() > 0:
            raise InputError(f"example input {where} is on {value.device} but the model is on "
                             f"{device}; move it with .to('{device}') or pass device=.")
        if (value.is_floating_point() and len(float_dtypes) == 1
                and value.dtype not in float_dtypes):
            model_dtype = next(iter(float_dtypes))
            raise InputError(f"example input {where} is {value.dtype} but the model's "
                             f"parameters are {model_dtype}; cast the input with "
                             f".to({model_dtype}) (or the model, for reduced precision).")


def _input_name(path: tuple[Any, ...]) -> str:
    text = "".join(str(p) for p in path)
    if text.startswith("[0]"):
        return "args" + text[3:]
    if text.startswith("[1]"):
        return "kwargs" + text[3:]
    return text or "input"


