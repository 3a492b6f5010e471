"""Why the device is idle, and the HTML report that shows it.

``diagnosis`` (``diagnose``, ``Diagnosis.apply``) runs a ``workload`` under the utilization
``sampler``, takes per-op evidence from ``per_op`` and names the causes in ``findings``;
``collect`` measures a model before and after ``optimize`` and ``render`` writes the report
(charts from ``charts``); ``profiling`` is ``autoopt profile``'s per-op table."""

from .diagnosis import Diagnosis, diagnose

__all__ = ["Diagnosis", "diagnose"]
