"""Why the device is idle, and the HTML report that shows it.

``diagnosis`` (``diagnose``, ``Diagnosis.apply``) runs a ``workload`` under the utilization
``sampler``, takes per-op evidence from ``per_op`` and names the causes in ``findings``;
``collect`` measures a model before and after ``optimize`` and ``render`` writes the report
(charts from ``charts``); ``profiling`` is ``autoopt profile``'s per-op table.

``Diagnosis`` and ``diagnose`` are imported on first use: ``import autoopt`` loads this
package and must not import torch."""

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from autoopt.diagnose.diagnosis import Diagnosis, diagnose

__all__ = ["Diagnosis", "diagnose"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from autoopt.diagnose import diagnosis

        return getattr(diagnosis, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
