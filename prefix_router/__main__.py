"""``python -m prefix_router COMMAND ...``: the same as ``prefix-router COMMAND ...``."""

import sys

from prefix_router.cli import main

if __name__ == "__main__":  # not when a spawned worker imports it (gateway --workers)
    sys.exit(main())
