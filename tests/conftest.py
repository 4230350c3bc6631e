"""Test-wide set-up and fixtures.

Ray stays on loopback (this machine's only allowed network): Ray reads this at
import, so it is set before any test module imports ray, and a single-machine Ray
then binds to 127.0.0.1 instead of the machine's address.
"""

import os

import pytest

from tests.shared import FakeClock

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")


@pytest.fixture
def clock() -> FakeClock:
    """Time that passes only when the test says so."""
    return FakeClock()
