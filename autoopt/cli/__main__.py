"""``python -m autoopt.cli``: the ``autoopt`` command without the console script."""

import sys

from autoopt.cli import main

sys.exit(main())
