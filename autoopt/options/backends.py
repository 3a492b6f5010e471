"""The backend names ``backend=``, ``backends=`` and ``AUTOOPT_BACKENDS`` may give: each is a
module of ``autoopt.backends`` holding that engine's ``BACKEND``. The one list: adding an engine
is its module and its name here, in the order of preference on a measured tie."""

from __future__ import annotations

BACKENDS: tuple[str, ...] = ("aten", "hybrid", "inductor", "onnxruntime", "openvino")
# A comma-separated list of backends: the default candidates when the config names none (a
# CI run or a serving fleet pins them without touching code).
BACKENDS_VARIABLE = "AUTOOPT_BACKENDS"

# What ``backend_options={"inductor": {...}}`` may set: torch.compile's ``mode`` (e.g.
# ``"max-autotune"``: Inductor benchmarks GEMM and convolution templates, minutes of compile
# for kernels that can be faster) and Inductor config ``options``.
INDUCTOR_OPTIONS: tuple[str, ...] = ("mode", "options")

# The backends that run static int8 (precision="int8" with calibration=): each quantizes with
# its own library (autoopt.backends.static_int8).
STATIC_INT8: tuple[str, ...] = ("openvino", "onnxruntime")
