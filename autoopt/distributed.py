"""``autoopt.distributed``, the path of ``autoopt.parallel.distributed`` before the layout of
2026-11-30: code written against it (``from autoopt.distributed import distributed_pipeline``)
keeps working. The very same module, not a copy, so names set or patched on one are seen through
the other."""

import sys

from autoopt.parallel import distributed as _module

sys.modules[__name__] = _module
