"""A short headless Locust run of the chat workload through a real gateway and replicas."""

import csv
import json
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.servers import running

pytestmark = pytest.mark.slow

LOCUSTFILE = Path(__file__).resolve().parents[2] / "loadtest" / "locustfile.py"


def test_a_headless_locust_run_completes_and_its_figures_agree(tmp_path):
    replica = ["replica", "--speedup", "20"]
    with running(replica, replica) as replicas:
        gateway_command = ["gateway", *[f"--backend={url}" for url in replicas]]
        with running(gateway_command) as (gateway,):
            command = [
                sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--headless",
                "-u", "3", "-r", "3", "-t", "12s", "--host", gateway,
                "--chat-num-sessions", "6", "--think-time-scale", "0",
                "--results-file", str(tmp_path / "client.json"), "--csv", str(tmp_path / "run"),
                "--only-summary",
            ]  # fmt: skip
            done = subprocess.run(
                command, cwd=tmp_path, capture_output=True, text=True, timeout=120, check=False
            )
            assert done.returncode == 0, done.stderr[-2000:]
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
