"""``python -m twophase ...``: the same CLI as the ``twophase`` console script."""

import sys

from twophase.cli import main

sys.exit(main())
