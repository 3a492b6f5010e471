"""``python -m autoopt``: the ``autoopt`` command without the console script."""

import sys

from autoopt.cli import main

sys.exit(main())
