"""autoopt: make PyTorch models use their hardware well.

    fast = autoopt.optimize(model, example_inputs)   # same function, verified against eager
    print(fast.report)                                # what was captured and rewritten
"""

from .api import OptimizedModule, optimize
from .capture.dynamo import autoopt_backend
from .config import OptimizeConfig
from .diagnose import Diagnosis, diagnose
from .errors import (
    AutoOptError,
    ConfigError,
    DependencyError,
    DeviceError,
    InputError,
    ModelError,
    ModelSpecError,
)
from .export.onnx import OnnxReport, OnnxVerificationError, export_onnx
from .export.session import OnnxSession, onnx_session
from .parallel.pipeline import Pipeline  # optimize(..., devices=[...]) returns one
from .report import CaptureRecord, PassRecord, Report
from .runtime import prefetch as data  # autoopt.data.prefetch: asynchronous loading
from .verify import Tolerance, VerifyResult

__version__ = "0.1.0"

__all__ = [
    "AutoOptError", "CaptureRecord", "ConfigError", "DependencyError", "DeviceError",
    "InputError", "ModelError",
    "ModelSpecError", "OnnxReport", "OnnxSession", "OnnxVerificationError", "OptimizeConfig",
    "OptimizedModule", "PassRecord", "Report", "Tolerance", "VerifyResult", "autoopt_backend",
    "export_onnx", "onnx_session", "optimize",
]
__all__ += ["Diagnosis", "data", "diagnose"]  # diagnosis and asynchronous loading
__all__ += ["Pipeline"]  # pipeline stages across devices (autoopt.parallel)
