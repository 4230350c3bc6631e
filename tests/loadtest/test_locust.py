"""A short headless Locust run of the chat workload through a real gateway and replicas."""

import contextlib
import csv
import json
import shlex
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver
from selenium.webdriver.support.ui import WebDriverWait

from deploy.processes import free_port, running
from tests.shared import settled

pytestmark = pytest.mark.slow

LOCUSTFILE = Path(__file__).resolve().parents[2] / "loadtest" / "locustfile.py"
#: Locust on our locustfile; the rest of a command line follows.
LOCUST = [sys.executable, "-m", "locust", "-f", str(LOCUSTFILE)]


def locust(tmp_path: Path, host: str, users: int, seconds: int, *options: str) -> None:
    flags = f"--headless -u {users} -r {users} -t {seconds}s --think-time-scale 0 --only-summary"
    results = ["--results-file", str(tmp_path / "client.json"), "--csv", str(tmp_path / "run")]
    command = [*LOCUST, "--host", host, *shlex.split(flags), *results, *options]
    done = subprocess.run(
        command, cwd=tmp_path, capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr[-2000:]


def test_a_headless_locust_run_completes_and_its_figures_agree(tmp_path):
    replica = ["replica", "--speedup", "20"]
    with running(replica, replica) as replicas:
        gateway_command = ["gateway", *[f"--backend={url}" for url in replicas]]
        with running(gateway_command) as (gateway,):
            settled(gateway, replicas)
            options = ["--chat-num-sessions", "6", "--session-keys"]
            locust(tmp_path, gateway, 3, 12, *options, "--html", str(tmp_path / "report.html"))
            engine = [httpx.get(url + "/stats").json()["cache"] for url in replicas]
            sessions = httpx.get(gateway + "/stats").json()["session_requests"]
    with open(tmp_path / "run_stats.csv", newline="") as stats_file:
        rows = {(r["Type"], r["Name"]): r for r in csv.DictReader(stats_file)}
    requests = int(rows[("POST", "chat")]["Request Count"])
    assert requests > 6 and int(rows[("POST", "chat")]["Failure Count"]) == 0
    assert sessions == requests  # every turn sent its session's key
    assert int(rows[("TTFT", "chat")]["Request Count"]) == requests
    assert int(rows[("ITL", "chat")]["Request Count"]) == requests
    client = json.loads((tmp_path / "client.json").read_text())
    assert client["requests"] == requests
    # Every session finished: the client's usage blocks and the engines' own counts agree.
    assert client["prompt_tokens"] == sum(e["query_tokens"] for e in engine)
    assert client["cached_tokens"] == sum(e["hit_tokens"] for e in engine)
    assert client["client_token_hit_rate"] > 0.5
    # Locust's own figures carry the same hit rate: its CSV...
    engines = 100 * sum(e["hit_tokens"] for e in engine) / sum(e["query_tokens"] for e in engine)
    hits = rows[("HIT%", "chat")]
    assert int(hits["Request Count"]) == requests
    assert float(hits["Average Response Time"]) == pytest.approx(engines, abs=0.01)
    assert float(hits["Median Response Time"]) == pytest.approx(engines, abs=0.5)  # bucketed
    per_answer = rows[("HIT%", "chat per answer")]
    assert int(per_answer["Request Count"]) == requests
    assert 0 <= float(per_answer["Min Response Time"]) <= float(per_answer["Max Response Time"])
    # ...and its HTML report (its figures are the page's data, as JSON).
    report = html_statistics(tmp_path / "report.html")
    assert report[("HIT%", "chat")]["avg_response_time"] == pytest.approx(engines, abs=0.01)
    assert report[("HIT%", "chat")]["num_requests"] == requests
    assert ("HIT%", "chat per answer") in report and ("TTFT", "chat") in report


def html_statistics(path: Path) -> dict[tuple[str, str], dict]:
    """The request statistics a Locust HTML report renders, by (type, name)."""
    page = path.read_text()
    start = page.index("window.templateArgs = ") + len("window.templateArgs = ")
    data, _ = json.JSONDecoder().raw_decode(page[start:])
    return {(s["method"], s["name"]): s for s in data["requests_statistics"]}


def test_open_loop_sessions_start_on_schedule_not_when_answers_come(tmp_path):
    with running(["replica", "--speedup", "20"]) as (replica,):
        locust(tmp_path, replica, 8, 10, "--chat-num-sessions", "8", "--arrival-rate", "2")
    starts = json.loads((tmp_path / "client.json").read_text())["session_starts"]
    assert len(starts) == 8
    due = sorted(d for d, _ in starts)
    assert due[-1] - due[0] > 1.0  # Poisson arrivals at 2 per second, not all at once
    for scheduled, started in starts:
        assert scheduled - 0.05 <= started <= scheduled + 1.0


@contextlib.contextmanager
def locust_web_ui(tmp_path: Path, host: str, *options: str) -> Iterator[str]:
    """Locust with its web UI on a free loopback port, started at once (``--autostart``);
    stopped however the test ends."""
    port = free_port()
    web = ["--web-host", "127.0.0.1", "--web-port", str(port), "--autostart"]
    users = shlex.split("-u 3 -r 3 --think-time-scale 0")
    command = [*LOCUST, "--host", host, *web, *users, *options]
    log = open(tmp_path / "locust.log", "w")  # noqa: SIM115  (closed below)
    process = subprocess.Popen(command, cwd=tmp_path, stdout=log, stderr=log)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        process.terminate()
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        log.close()


def wait_for_state(ui: str, state: str, timeout_s: float = 60.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError):
            figures = httpx.get(ui + "/stats/requests", timeout=2).json()
            if figures.get("state") == state:
                return figures
        time.sleep(0.5)
    raise TimeoutError(f"Locust's web UI at {ui} never reached {state!r}")


def test_the_web_ui_shows_the_hit_rate_in_its_own_tab_and_route(tmp_path, browser):
    replica = ["replica", "--speedup", "20"]
    with running(replica, replica) as replicas:
        gateway_command = ["gateway", *[f"--backend={url}" for url in replicas]]
        with (
            running(gateway_command) as (gateway,),
            contextlib.ExitStack() as ready,
        ):
            settled(gateway, replicas)
            ui = ready.enter_context(locust_web_ui(tmp_path, gateway, "--chat-num-sessions", "4"))
            # Every session played, the run stops itself; the UI stays up.
            figures = wait_for_state(ui, "stopped")
            engine = [httpx.get(url + "/stats").json()["cache"] for url in replicas]
            hits = httpx.get(ui + "/prefix-router/cache-hits").json()["rows"]
            as_csv = httpx.get(ui + "/prefix-router/cache-hits/csv").text
            page = httpx.get(ui + "/").text
            tab = cache_hits_tab(browser, ui)
            browser.save_screenshot(str(tmp_path / "locust_cache_hits.png"))
    rate = sum(e["hit_tokens"] for e in engine) / sum(e["query_tokens"] for e in engine)
    (chat,) = hits
    assert chat["name"] == "chat" and chat["answers"] > 4
    assert chat["prompt_tokens"] == sum(e["query_tokens"] for e in engine)
    assert chat["token_hit_rate"] == f"{100 * rate:.1f}%"
    assert chat["recent_hit_rate"] == chat["token_hit_rate"]  # the run took under a minute
    # The tab's rows ride on the statistics the UI polls, beside the HIT% entries.
    (extended,) = figures["extended_stats"]
    assert extended["key"] == "cache-hits" and extended["data"] == hits
    entries = {(s["method"], s["name"]) for s in figures["stats"]}
    assert {("HIT%", "chat"), ("HIT%", "chat per answer"), ("TTFT", "chat")} <= entries
    assert as_csv.splitlines()[0].startswith("Name,Answers,Prompt tokens,Cached tokens")
    assert '"extended_tabs"' in page and "Cache hits" in page  # the tab the page renders
    # In a real browser: the tab is there, and shows the same row.
    columns = ["Name", "Answers", "Prompt tokens", "Cached tokens", "Token hit rate"]
    assert tab[0] == [*columns, "Last minute"]
    keys = ("name", "answers", "prompt_tokens", "cached_tokens", "token_hit_rate")
    assert tab[1] == [str(chat[key]) for key in (*keys, "recent_hit_rate")]


def named(driver: WebDriver, title: str) -> list:
    return [t for t in driver.find_elements(By.CSS_SELECTOR, "[role=tab]") if t.text == title]


def cache_hits_tab(browser: WebDriver, ui: str) -> list[list[str]]:
    """The cells of Locust's "Cache hits" tab, as a person would open it."""
    browser.get(ui)
    wait = WebDriverWait(browser, 30)
    tab = wait.until(lambda d: next(iter(named(d, "CACHE HITS")), None))
    tab.click()
    rows = wait.until(lambda d: len(found := d.find_elements(By.CSS_SELECTOR, "tr")) > 1 and found)
    return [[cell.text for cell in row.find_elements(By.CSS_SELECTOR, "th,td")] for row in rows]
