"""Test-wide set-up and fixtures.

Ray stays on loopback (this machine's only allowed network): Ray reads this at
import, so it is set before any test module imports ray, and a single-machine Ray
then binds to 127.0.0.1 instead of the machine's address.
"""

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings
from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.remote.webdriver import WebDriver

from tests.shared import FakeClock

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

# The suite runs beside Ray clusters and vLLM servers on two cores: Hypothesis judges
# what a test asserts, not how fast the machine draws its inputs (a busy run drew one
# body in 2 s and failed its health check).
settings.register_profile("shared-machine", suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("shared-machine")


@pytest.fixture
def clock() -> FakeClock:
    """Time that passes only when the test says so."""
    return FakeClock()


CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
#: This machine reaches only loopback: nothing in the background may try the network.
CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--window-size=1400,1000",
]


@pytest.fixture
def browser(tmp_path: Path) -> Iterator[WebDriver]:
    """Headless Chromium (Debian's, which ``make test`` installs) with a fresh profile,
    quit however the test ends."""
    missing = [path for path in (CHROMIUM, CHROMEDRIVER) if not Path(path).exists()]
    assert not missing, f"install Debian's chromium and chromium-driver (missing: {missing})"
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in [*CHROMIUM_FLAGS, f"--user-data-dir={tmp_path / 'chromium-profile'}"]:
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    try:
        yield driver
    finally:
        driver.quit()


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama of `prefix-router tiny-model` (written once per run): what the
    tests' vLLM servers serve."""
    from replica.tiny_model import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("tiny-model"))
