"""The dashboard in a real browser (headless Chromium) in front of a small live fleet.

The page must show what the gateway's ``/stats`` (and the replicas' own) say, ask
for an admin key when keys are configured, keep prompt text hidden until asked, and
say so when the gateway has no backends. Chromium comes from the system's packages
(``make test`` installs ``chromium`` and ``chromium-driver`` when they are missing).
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
import pytest
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver
from selenium.webdriver.support.ui import WebDriverWait

from deploy.processes import free_port, running, start, stop, wait_until
from replica.api.identity import DEFAULT_MODEL
from tests.router.dashboard.page import cell, refreshed_after
from tests.shared import gateway_stats, replica_stats, settled, wait_until_indexed

pytestmark = pytest.mark.slow

ADMIN, TENANT = "admin-key-for-tests", "tenant-key-for-tests"
ADAPTER = "sql"
SYSTEMS = [f"Application {a} answers questions about product {a}. " * 12 for a in range(3)]


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, list[str]]]:
    """A gateway with API keys in front of two replicas with a host tier, the first
    serving a LoRA adapter too."""
    keys = tmp_path_factory.mktemp("keys") / "keys.txt"
    keys.write_text(f"{ADMIN} ops admin\n{TENANT} acme\n")
    replica = ["replica", "--speedup", "20", "--num-blocks", "256", "--host-blocks", "1024"]
    with running([*replica, "--lora-modules", ADAPTER], replica) as replicas:
        backends = [f"--backend={url}" for url in replicas]
        gateway = ["gateway", *backends, "--api-keys-file", str(keys)]
        with running(gateway) as (url,):
            settled(url, replicas)
            yield url, replicas


def drive_traffic(url: str, requests: int = 36, adapter_requests: int = 4) -> None:
    """36 requests over three system prompts, then 4 on the first naming the adapter."""
    with httpx.Client(timeout=30, headers={"authorization": f"Bearer {TENANT}"}) as client:
        for i in range(requests + adapter_requests):
            adapter = i >= requests
            body = {"prompt": SYSTEMS[0 if adapter else i % 3] + f"Question {i}?", "max_tokens": 4}
            if adapter:
                body["model"] = ADAPTER
            client.post(f"{url}/v1/completions", json=body).raise_for_status()


def status(driver: WebDriver) -> str:
    return str(driver.find_element(By.ID, "status").text)


def use_key(driver: WebDriver, key: str) -> None:
    driver.find_element(By.ID, "key").send_keys(key)
    driver.find_element(By.CSS_SELECTOR, "#key-form button").click()


def test_the_page_shows_what_stats_says_once_given_an_admin_key(fleet, browser, tmp_path):
    url, replicas = fleet
    browser.get(f"{url}/dashboard")
    WebDriverWait(browser, 30).until(lambda d: "enter an admin key" in status(d))
    use_key(browser, TENANT)
    WebDriverWait(browser, 30).until(lambda d: "not an admin's" in status(d))
    use_key(browser, ADMIN)
    refreshed_after(browser, 0.0)
    # A refresh with every replica's own figures, before any traffic: the start of
    # the last-minute window (a fetch can time out while the machine is busy).
    WebDriverWait(browser, 30).until(
        lambda d: all(
            cell(d, f'#replicas tr[data-replica="{b.replica_id}"]', "gpu_cached_blocks")[1]
            for b in gateway_stats(url, ADMIN).backends
        )
    )

    drive_traffic(url)
    wait_until_indexed(url, key=ADMIN)  # every block counted in the tenant's footprint
    ended = time.time()
    refreshed_after(browser, ended + 1.0)  # a second sample after the traffic: chart points
    stats = gateway_stats(url, ADMIN)
    assert stats.totals.requests == 40
    assert cell(browser, "#fleet", "requests")[0] == "40"
    hit_rate = stats.totals.token_hit_rate
    assert hit_rate and hit_rate > 0.5
    assert cell(browser, "#fleet", "token_hit_rate")[0] == f"{100 * hit_rate:.1f}%"
    assert not browser.find_element(By.ID, "no-backends").is_displayed()

    for backend, replica_url in zip(stats.backends, replicas, strict=True):
        row = f'#replicas tr[data-replica="{backend.replica_id}"]'
        assert cell(browser, row, "dispatched")[0] == str(backend.dispatched)
        assert cell(browser, row, "outstanding_requests")[0] == "0"
        assert cell(browser, row, "outstanding_prefill_tokens")[0] == "0"
        assert cell(browser, row, "routing_mode")[0] == backend.routing_mode == "precise"
        assert cell(browser, row, "model")[1] == backend.model == DEFAULT_MODEL
        own = replica_stats(replica_url).cache
        assert cell(browser, row, "gpu_cached_blocks")[1] == str(own.cached_blocks)
        assert cell(browser, row, "host_cached_blocks")[1] == str(own.host_cached_blocks)
        # The window began at the page's first refresh, before any traffic.
        window = cell(browser, row, "window_hit_rate")[1]
        if own.token_hit_rate is None:  # cache_aware may keep every prompt on one replica
            assert window == "" and backend.dispatched == 0
        else:
            assert float(window) == pytest.approx(own.token_hit_rate)

    # the models table: the base model and the adapter, as /stats counts them
    adapter_row = f'#models tr[data-model="{ADAPTER}"]'
    base_row = f'#models tr[data-model="{DEFAULT_MODEL}"]'
    assert stats.models[DEFAULT_MODEL].requests == 36 and stats.models[ADAPTER].requests == 4
    assert cell(browser, base_row, "requests")[0] == "36"
    assert cell(browser, adapter_row, "requests")[0] == "4"
    assert cell(browser, adapter_row, "base")[0] == DEFAULT_MODEL
    adapter_hits = stats.models[ADAPTER].token_hit_rate
    assert cell(browser, adapter_row, "token_hit_rate")[0] == f"{100 * adapter_hits:.1f}%"
    first = stats.backends[0].replica_id  # the replica that serves the adapter
    assert cell(browser, adapter_row, "replicas")[1] == first
    assert cell(browser, adapter_row, "loaded_on")[1] == first  # its only slot user
    first_row = f'#replicas tr[data-replica="{first}"]'
    assert cell(browser, first_row, "model")[0] == f"{DEFAULT_MODEL} + {ADAPTER}"

    # the tenants table: the key's tenant, its charge and its blocks on the GPUs
    acme, acme_row = stats.tenants["acme"], '#tenants tr[data-tenant="acme"]'
    assert browser.find_element(By.ID, "tenants-section").is_displayed()
    assert cell(browser, acme_row, "requests")[0] == "40"
    assert cell(browser, acme_row, "charged_tokens")[1] == str(acme.charged_tokens) != "0"
    held = {r: blocks for r, blocks in acme.gpu_blocks.items() if blocks}
    assert cell(browser, acme_row, "gpu_blocks")[1] == str(sum(held.values())) != "0"
    assert cell(browser, acme_row, "replicas_held")[1] == str(len(held))

    policy = stats.policies["cache_aware"]
    row = '#policies tr[data-policy="cache_aware"]'
    assert cell(browser, row, "requests")[0] == "40"
    assert cell(browser, row, "token_hit_rate")[0] == f"{100 * policy.token_hit_rate:.1f}%"
    assert float(cell(browser, row, "ttft_p50_s")[1]) == pytest.approx(policy.ttft_p50_s)
    counts = stats.by_policy("cache_aware")
    accuracy = sum(c.close_predictions for c in counts) / sum(c.predictions for c in counts)
    assert float(cell(browser, row, "prediction_accuracy")[1]) == pytest.approx(accuracy)
    assert browser.find_elements(By.CSS_SELECTOR, "#chart-hit canvas")

    hot = browser.execute_script(
        "return [...document.querySelectorAll('#hot tbody tr')].map(r => r.dataset.prefix);"
    )
    assert len(hot) == 4  # one per system prompt, and the first under the adapter
    assert all(len(prefix) == 16 for prefix in hot)
    assert "Application 1" not in browser.page_source  # no prompt text unless asked
    browser.save_screenshot(str(tmp_path / "dashboard.png"))
    assert (tmp_path / "dashboard.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    browser.find_element(By.ID, "show-text").click()
    WebDriverWait(browser, 30).until(lambda d: "Application 1 answers" in d.page_source)


@pytest.fixture
def lonely_gateway() -> Iterator[str]:
    """A gateway with no backends (its /health answers 503, so ``running`` cannot wait)."""
    port = free_port()
    process = start(["gateway"], port)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_until(url, process, ready=lambda response: response.status_code == 503)
        yield url
    finally:
        stop(process)


def test_the_page_says_when_the_gateway_has_no_backends(lonely_gateway, browser, tmp_path):
    browser.get(f"{lonely_gateway}/dashboard")
    banner = browser.find_element(By.ID, "no-backends")
    WebDriverWait(browser, 30).until(lambda d: banner.is_displayed())
    assert "no backends" in banner.text
    browser.save_screenshot(str(tmp_path / "no-backends.png"))
