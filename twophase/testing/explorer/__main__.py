"""``python -m twophase.testing.explorer``: runs :func:`twophase.testing.explorer.cli.main`."""

import sys

from twophase.testing.explorer.cli import main

if __name__ == "__main__":
    sys.exit(main())
