"""autoopt: make PyTorch models use their hardware well.

    fast = autoopt.optimize(model, example_inputs)   # same function, verified against eager
    print(fast.report)                                # what was captured and rewritten

The public names are imported on first use (PEP 562): ``import autoopt`` imports no torch, so
that ``autoopt --help`` and ``--version`` answer in a fraction of a second instead of the
seconds torch and the whole library take to import.
"""

from importlib import import_module
from typing import TYPE_CHECKING, Any

from autoopt import diagnose as _diagnose_package  # noqa: F401 - light; loaded now, see below
from autoopt import old_paths
from autoopt.errors import (
    AutoOptError,
    ConfigError,
    DependencyError,
    DeviceError,
    InputError,
    ModelError,
    ModelSpecError,
)

old_paths.install()  # ``autoopt.verify``, ``autoopt.data``: modules that moved, still importable

# Importing the subpackage bound ``autoopt.diagnose`` to it; the public name is the function.
# The subpackage is in sys.modules now, so no later import rebinds it.
del globals()["diagnose"]

if TYPE_CHECKING:  # what the lazy names are, for type checkers and IDEs
    from autoopt.api import OptimizedModule, optimize
    from autoopt.check.compare import Tolerance, VerifyResult
    from autoopt.check.report import CaptureRecord, PassRecord, Report
    from autoopt.compile.dynamo import autoopt_backend
    from autoopt.diagnose.diagnosis import Diagnosis, diagnose
    from autoopt.export.onnx import OnnxReport, OnnxVerificationError, export_onnx
    from autoopt.onnx.session import OnnxSession, onnx_session
    from autoopt.options.config import OptimizeConfig
    from autoopt.parallel.pipeline import Pipeline
    from autoopt.runtime import prefetch as data

__version__ = "0.1.0"

# Public name -> the module that defines it (``data`` is a module: autoopt.data.prefetch).
_LAZY = {
    "OptimizedModule": ".api", "optimize": ".api", "autoopt_backend": ".compile.dynamo",
    "OptimizeConfig": ".options.config", "Diagnosis": ".diagnose.diagnosis",
    "diagnose": ".diagnose.diagnosis", "OnnxReport": ".export.onnx",
    "OnnxVerificationError": ".export.onnx", "export_onnx": ".export.onnx",
    "OnnxSession": ".onnx.session", "onnx_session": ".onnx.session",
    "Pipeline": ".parallel.pipeline", "CaptureRecord": ".check.report",
    "PassRecord": ".check.report", "Report": ".check.report", "Tolerance": ".check.compare",
    "VerifyResult": ".check.compare",
}

__all__ = [
    "AutoOptError", "CaptureRecord", "ConfigError", "DependencyError", "DeviceError",
    "InputError", "ModelError",
    "ModelSpecError", "OnnxReport", "OnnxSession", "OnnxVerificationError", "OptimizeConfig",
    "OptimizedModule", "PassRecord", "Report", "Tolerance", "VerifyResult", "autoopt_backend",
    "export_onnx", "onnx_session", "optimize",
]
__all__ += ["Diagnosis", "data", "diagnose"]  # diagnosis and asynchronous loading
__all__ += ["Pipeline"]  # pipeline stages across devices (autoopt.parallel)


def __getattr__(name: str) -> Any:
    """A public name, or a subpackage (``autoopt.passes``), imported on first use."""
    if name == "data":
        value: Any = import_module(".runtime.prefetch", __name__)
    elif name in _LAZY:
        value = getattr(import_module(_LAZY[name], __name__), name)
    elif not name.startswith("_"):
        try:
            return import_module(f".{name}", __name__)
        except ModuleNotFoundError as exc:
            if exc.name != f"{__name__}.{name}":
                raise  # the submodule exists and failed to import something: say so
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
