"""Test-wide set-up: Ray stays on loopback (this machine's only allowed network).

Ray reads this at import, so it is set before any test module imports ray: a
single-machine Ray then binds to 127.0.0.1 instead of the machine's address.
"""

import os

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
