"""``autoopt.data``, the path of ``autoopt.runtime.prefetch`` before the layout of 2026-11-30: code
written against it (``from autoopt.data import prefetch``) keeps working. The very same module,
not a copy, so names set or patched on one are seen through the other."""

import sys

from autoopt.runtime import prefetch as _module

sys.modules[__name__] = _module
