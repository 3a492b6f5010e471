"""``python -m autoopt``: the ``autoopt`` command without the console script."""

import sys

from .cli import main

sys.exit(main())
