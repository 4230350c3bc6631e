"""Reading the dashboard in a browser test: its refreshes and its cells' raw values."""

from __future__ import annotations

from selenium.common.exceptions import NoSuchElementException
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver
from selenium.webdriver.support.ui import WebDriverWait


def refreshed_after(driver: WebDriver, moment: float, timeout_s: float = 30) -> None:
    """Wait for a refresh whose figures the gateway computed after ``moment``."""

    def done(d: WebDriver) -> bool:
        shown = d.find_element(By.TAG_NAME, "body").get_attribute("data-refreshed")
        return bool(shown) and float(shown) > moment

    WebDriverWait(driver, timeout_s).until(done)


def shown(driver: WebDriver, selector: str) -> tuple[str, str]:
    """An element's text and raw value, read in one script: the page re-renders its
    tables on every refresh, so an element found first and read after can be stale."""
    found = driver.execute_script(
        "const e = document.querySelector(arguments[0]);"
        "return e && [e.innerText.trim(), e.getAttribute('data-value')];",
        selector,
    )
    if found is None:
        raise NoSuchElementException(f"nothing matches {selector}")
    text, value = found
    return str(text), str(value)


def cell(driver: WebDriver, row: str, field: str) -> tuple[str, str]:
    """A table cell's text and raw value."""
    return shown(driver, f'{row} [data-field="{field}"]')
