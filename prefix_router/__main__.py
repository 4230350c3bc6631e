"""``python -m prefix_router COMMAND ...``: the same as ``prefix-router COMMAND ...``."""

import sys

from prefix_router.cli import main

sys.exit(main())
