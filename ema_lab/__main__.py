"""``python -m ema_lab demo | bench | compare``: the command line lives in :mod:`ema_lab.bench.cli`."""

import sys

from .bench.cli import main

if __name__ == "__main__":
    sys.exit(main())
