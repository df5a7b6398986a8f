"""``python -m wb``: see :mod:`wb.cli`."""

import sys

from wb.cli import main

if __name__ == "__main__":
    sys.exit(main())
