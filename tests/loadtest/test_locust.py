"""A short headless Locust run of the chat workload through a real gateway and replicas."""

import csv
import json
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from deploy.processes import running

pytestmark = pytest.mark.slow

LOCUSTFILE = Path(__file__).resolve().parents[2] / "loadtest" / "locustfile.py"


def locust(tmp_path: Path, host: str, users: int, seconds: int, *options: str) -> None:
    command = [
        sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--headless", "-u", str(users),
        "-r", str(users), "-t", f"{seconds}s", "--host", host, "--think-time-scale", "0",
        "--results-file", str(tmp_path / "client.json"), "--csv", str(tmp_path / "run"),
        "--only-summary", *options,
    ]  # fmt: skip
    done = subprocess.run(
        command, cwd=tmp_path, capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr[-2000:]


def test_a_headless_locust_run_completes_and_its_figures_agree(tmp_path):
    replica = ["replica", "--speedup", "20"]
    with running(replica, replica) as replicas:
        gateway_command = ["gateway", *[f"--backend={url}" for url in replicas]]
        with running(gateway_command) as (gateway,):
            locust(tmp_path, gateway, 3, 12, "--chat-num-sessions", "6")
            engine = [httpx.get(url + "/stats").json()["cache"] for url in replicas]
    with open(tmp_path / "run_stats.csv", newline="") as stats_file:
        rows = {(r["Type"], r["Name"]): r for r in csv.DictReader(stats_file)}
    requests = int(rows[("POST", "chat")]["Request Count"])
    assert requests > 6 and int(rows[("POST", "chat")]["Failure Count"]) == 0
    assert int(rows[("TTFT", "chat")]["Request Count"]) == requests
    assert int(rows[("ITL", "chat")]["Request Count"]) == requests
    client = json.loads((tmp_path / "client.json").read_text())
    assert client["requests"] == requests
    # Every session finished: the client's usage blocks and the engines' own counts agree.
    assert client["prompt_tokens"] == sum(e["query_tokens"] for e in engine)
    assert client["cached_tokens"] == sum(e["hit_tokens"] for e in engine)
    assert client["client_token_hit_rate"] > 0.5


def test_open_loop_sessions_start_on_schedule_not_when_answers_come(tmp_path):
    with running(["replica", "--speedup", "20"]) as (replica,):
        locust(tmp_path, replica, 8, 10, "--chat-num-sessions", "8", "--arrival-rate", "2")
    starts = json.loads((tmp_path / "client.json").read_text())["session_starts"]
    assert len(starts) == 8
    due = sorted(d for d, _ in starts)
    assert due[-1] - due[0] > 1.0  # Poisson arrivals at 2 per second, not all at once
    for scheduled, started in starts:
        assert scheduled - 0.05 <= started <= scheduled + 1.0
