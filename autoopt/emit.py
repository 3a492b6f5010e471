"""``autoopt.emit``, the path of ``autoopt.export.program`` before the layout of 2026-11-30: code
written against it (``autoopt.emit.save_program``) keeps working. The very same module, not a
copy, so names set or patched on one are seen through the other."""

import sys

from autoopt.export import program as _module

sys.modules[__name__] = _module
