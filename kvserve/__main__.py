"""``python -m kvserve``: the same command line as the ``kvserve`` console script."""

import sys

from kvserve.cli import main

if __name__ == "__main__":
    sys.exit(main())
