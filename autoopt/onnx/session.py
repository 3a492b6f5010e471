"""ONNX Runtime sessions that take and return torch tensors.

    session = autoopt.onnx_session("model.onnx", device="cuda")
    y = session(x)                       # or session.run({"x": x}) -> {output name: tensor}

``onnx_session`` chooses the execution providers for the device (TensorRT, CUDA, then CPU, of
those installed); ``OnnxSession`` binds a call's inputs as Python binds arguments and, on CUDA,
keeps inputs and outputs on the GPU through IO binding. onnxruntime is imported inside
``onnx_session``: ``import autoopt`` stays fast.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from autoopt.errors import (
    ArgumentError,
    AutoOptError,
    DeviceError,
    InputError,
    ModelSpecError,
    first_line,
    require,
)

log = logging.getLogger(__name__)


# Preferred first: TensorRT builds fused engines, CUDA runs every op, CPU catches the rest.
_GPU_PROVIDERS = ("TensorrtExecutionProvider", "CUDAExecutionProvider")
_ONNX_TYPES = {"tensor(float)": torch.float32, "tensor(float16)": torch.float16,
               "tensor(double)": torch.float64, "tensor(bfloat16)": torch.bfloat16,
               "tensor(int64)": torch.int64, "tensor(int32)": torch.int32,
               "tensor(bool)": torch.bool, "tensor(uint8)": torch.uint8,
               "tensor(int8)": torch.int8}


class OnnxSession:
    """An ONNX Runtime session that takes and returns torch tensors.

    Call it like the model (positional inputs in the file's input order, or by name); it
    returns one tensor, or a tuple when the model has several outputs. ``run`` maps names to
    tensors. On CUDA, inputs and outputs stay on the GPU through IO binding.
    """

    def __init__(self, session: Any, device: torch.device, io_binding: bool) -> None:
        self.session = session
        self.device = device
        self.providers: list[str] = session.get_providers()
        self.input_names = [i.name for i in session.get_inputs()]
        self.output_names = [o.name for o in session.get_outputs()]
        self.input_types = {i.name: _ONNX_TYPES.get(i.type) for i in session.get_inputs()}
        self.input_shapes = {i.name: list(i.shape) for i in session.get_inputs()}
        self._io_binding = io_binding

    def __call__(self, *args: torch.Tensor, **kwargs: torch.Tensor,
                 ) -> torch.Tensor | tuple[torch.Tensor, ...]:
        # Bound as Python binds a call: positions first, in the file's input order (the
        # forward's), then keywords, each input once.
        if len(args) > len(self.input_names):
            raise ArgumentError(f"{len(args)} positional inputs, but the model has "
                                f"{len(self.input_names)}: {self.input_names}")
        feeds = dict(zip(self.input_names, args, strict=False))
        twice = [name for name in kwargs if name in feeds]
        if twice:
            position = self.input_names.index(twice[0])
            raise ArgumentError(f"got multiple values for input {twice[0]!r}: as positional "
                                f"input {position} and as a keyword (the inputs, in order, "
                                f"are {self.input_names})")
        feeds.update(kwargs)
        outputs = self.run(feeds)
        values = tuple(outputs[n] for n in self.output_names)
        return values[0] if len(values) == 1 else values

    def run(self, feeds: Mapping[str, Any]) -> dict[str, torch.Tensor]:
        """Run on ``{input name: tensor}`` (torch tensors or numpy arrays); return
        ``{output name: tensor}``."""
        # Types first: a list where the file takes its tensors one by one is the real mistake,
        # not the inputs it leaves missing.
        feeds = {name: self._tensor(name, value) for name, value in feeds.items()}
        unknown = sorted(set(feeds) - set(self.input_names))
        missing = [n for n in self.input_names if n not in feeds]
        if unknown or missing:
            raise ArgumentError(f"the ONNX model's inputs are {self.input_names}; "
                                + (f"unknown: {unknown} " if unknown else "")
                                + (f"missing: {missing}" if missing else ""))
        return dict(zip(self.output_names, self._execute(feeds), strict=True))

    def run_ordered(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Run on one torch tensor per input in ``input_names`` order; return the outputs in
        ``output_names`` order, each a new tensor of its own.

        ``run`` without its checks of names and types, for a caller that has matched its
        inputs to the file already (``OrtGraph``, after the optimized module's guards): a call
        of a small model spends as long in those checks as in ONNX Runtime's own Python.
        ONNX Runtime still rejects a wrong shape or dtype, as an ``InputError``.
        """
        return self._execute(dict(zip(self.input_names, tensors, strict=True)))

    def _execute(self, feeds: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        try:
            if self._io_binding:
                return self._run_bound(feeds)
            arrays = {n: _array(t) for n, t in feeds.items()}
            values = self.session.run(self.output_names, arrays)
        except AutoOptError:
            raise
        except Exception as exc:
            raise InputError(f"ONNX Runtime rejected the inputs "
                             f"({_describe(feeds)}; expected {self.input_shapes}): "
                             f"{' '.join(str(exc).split())[:500]}") from exc
        # ORT returns arrays it allocated for this run: the tensors share nothing with the
        # next call's.
        return [torch.from_numpy(v) for v in values]

    def _tensor(self, name: str, value: Any) -> torch.Tensor:
        if isinstance(value, torch.Tensor):
            return value
        if type(value).__module__ == "numpy" and hasattr(value, "__array__"):
            try:
                return torch.as_tensor(value)
            except (TypeError, RuntimeError) as exc:
                raise InputError(f"input {name!r}: a numpy array of dtype {value.dtype} that "
                                 f"torch cannot hold ({exc}); pass a torch.Tensor.") from exc
        hint = ""
        if isinstance(value, (list, tuple, dict)):
            flat = [n for n in self.input_names if n.startswith(f"{name}_")]
            hint = (f"; the file takes a {type(value).__name__}'s tensors as separate inputs: "
                    f"pass them as {', '.join(flat)}" if flat else
                    f"; the ONNX model takes one tensor per input ({self.input_names})")
        raise InputError(f"input {name!r} is a {type(value).__name__}, not a tensor{hint}. "
                         f"Pass torch tensors (or numpy arrays).")

    def _run_bound(self, feeds: Mapping[str, torch.Tensor]) -> list[torch.Tensor]:
        # Inputs are read where they are and outputs are left where ORT wrote them (shared
        # with torch through DLPack): on a GPU, no copy through the host in either direction.
        kind = self.device.type
        index = self.device.index or 0
        binding = self.session.io_binding()
        keep = []  # the bound memory must outlive the run
        for name, value in feeds.items():
            value = value.detach().to(self.device).contiguous()
            keep.append(value)
            binding.bind_input(name, kind, index, _numpy_dtype(value.dtype),
                               tuple(value.shape), value.data_ptr())
        for name in self.output_names:
            binding.bind_output(name, kind, index)
        self.session.run_with_iobinding(binding)
        outputs = binding.get_outputs()
        return [torch.from_dlpack(v) for v in outputs]


def _array(tensor: torch.Tensor) -> Any:
    """The tensor's memory as a numpy array (a copy only from another device)."""
    if tensor.requires_grad or not tensor.is_cpu:
        # Each of these is a dispatched call (detach makes a new tensor): skipped for the
        # plain CPU tensor of an inference call.
        tensor = tensor.detach().cpu()
    return tensor.numpy()


def _numpy_dtype(dtype: torch.dtype) -> Any:
    return torch.empty((), dtype=dtype).numpy().dtype


def _describe(feeds: Mapping[str, torch.Tensor]) -> str:
    return ", ".join(f"{n}: {str(t.dtype).removeprefix('torch.')}{list(t.shape)}"
                     for n, t in feeds.items())


def onnx_session(path: str | Path, device: str | torch.device = "cpu",
                 threads: int | None = None, optimized_model_path: str | Path | None = None,
                 ) -> OnnxSession:
    """Open an ONNX model with ONNX Runtime, ready to call with torch tensors.

    Args:
        path: the ``.onnx`` file.
        device: ``cpu``, ``cuda`` or ``cuda:N``. On CUDA the execution providers are
            TensorRT, CUDA and CPU, in that order, of those installed
            (``onnxruntime.get_available_providers()``); on the CPU, the CPU provider.
        threads: ORT intra-op threads; default: ORT's (one per physical core).
        optimized_model_path: where to save the model after ORT's graph optimizations.

    Returns:
        An ``OnnxSession``: ``session(x)`` or ``session.run({"x": x})``.

    Example:
        >>> session = autoopt.onnx_session("resnet.onnx", device="cuda")
        >>> logits = session(torch.randn(8, 3, 224, 224, device="cuda"))
    """
    ort = require("onnxruntime", "an ONNX Runtime session",
                  "pip install onnxruntime (onnxruntime-gpu for CUDA)")
    path = Path(path)
    if not path.is_file():
        raise ModelSpecError(f"no such .onnx file: {str(path)!r}")
    try:
        target = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise DeviceError(f"device={device!r} is not a device name; use 'cpu', 'cuda' or "
                          f"'cuda:N'.") from exc
    providers = _providers(ort, target, device)
    options_ = _options(ort, threads)
    if optimized_model_path is not None:
        options_.optimized_model_filepath = str(optimized_model_path)
        if (path.parent / f"{path.name}.data").exists():
            # A model too big for one protobuf stays too big after optimization.
            options_.add_session_config_entry(
                "session.optimized_model_external_initializers_file_name",
                f"{Path(optimized_model_path).name}.data")
    try:
        session = ort.InferenceSession(str(path), options_, providers=providers)
    except Exception as exc:
        raise ModelSpecError(f"{str(path)!r} is not a readable ONNX model: "
                             f"{first_line(exc)}") from exc
    # DEBUG: a backend candidate's session is a temporary file, no news to a progress line.
    log.debug("ONNX Runtime session for %s on %s", path, session.get_providers())
    return OnnxSession(session, target, io_binding=target.type == "cuda")


def _providers(ort: Any, target: torch.device, device: Any) -> list[Any]:
    """The execution providers for ``target``: TensorRT, CUDA, then CPU of those installed
    on CUDA; the CPU provider on the CPU."""
    available = ort.get_available_providers()
    if target.type == "cuda":
        installed = [p for p in _GPU_PROVIDERS if p in available]
        if not installed:
            raise DeviceError(f"device={device!r}, but this onnxruntime has no GPU execution "
                              f"provider (available: {available}); install onnxruntime-gpu "
                              f"(pip install 'autoopt[gpu]') or use device='cpu'.")
        options = {"device_id": target.index or 0}
        if torch.cuda.is_available():
            # ORT then works on torch's stream, so bound inputs are ready without a sync.
            stream = torch.cuda.current_stream(target.index or 0).cuda_stream
            options["user_compute_stream"] = str(stream)
        providers: list[Any] = [(p, dict(options)) for p in installed]
        providers.append("CPUExecutionProvider")
        return providers
    if target.type == "cpu":
        return ["CPUExecutionProvider"]
    raise DeviceError(f"device={device!r}: ONNX sessions run on 'cpu' or 'cuda'.")


def _options(ort: Any, threads: int | None) -> Any:
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    # Fatal only: ORT's errors come back as exceptions (reworded below), its warnings are
    # about its own choices, and a library should not write to the user's stderr.
    options.log_severity_level = 4
    if threads:
        options.intra_op_num_threads = threads
    return options
