"""Why the device is idle: the diagnosis (``diagnosis``), its utilization sampler, the
per-op profile and the HTML report."""

from .diagnosis import Diagnosis, diagnose

__all__ = ["Diagnosis", "diagnose"]
