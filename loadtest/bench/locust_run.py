"""One run of the workload: Locust in its own process, the fleet sampled every second."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import psutil
from tqdm import tqdm

from deploy.flags import config_flags
from loadtest.bench.config import BenchConfig
from loadtest.bench.targets import Fleet, engine_figures, gateway_stats, replica_stats
from loadtest.timeline import Timeline
from loadtest.workloads import ChatConfig, workload_kind
from replica.api.fleet_token import bearer
from replica.api.stats import ReplicaStats

LOCUSTFILE = Path(__file__).parent.parent / "locustfile.py"


@dataclass
class LocustRun:
    """Locust's and the client's figures of one run."""

    requests: int
    failures: int
    elapsed_s: float
    client: dict[str, Any]
    cpu_busy: float
    cpu_busy_peak: float
    timeline: Timeline


def locust_command(config: BenchConfig, gateways: list[str], prefix: Path) -> list[str]:
    users = str(config.users)
    command = [sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--headless"]
    command += ["-u", users, "-r", users, "-t", f"{config.run_time_s:.0f}s"]
    command += ["--host", gateways[0], "--gateways", ",".join(gateways)]
    command += ["--csv", str(prefix), "--results-file", f"{prefix}_client.json"]
    command += ["--only-summary", "--loglevel", "WARNING", "--stop-timeout", "10"]
    command += ["--workload", config.workload, "--workload-seed", str(config.seed)]
    command += ["--model", config.model]
    if config.trace_limit:
        command += ["--trace-limit", str(config.trace_limit)]
    if config.session_keys:
        command += ["--session-keys"]
    if workload_kind(config.workload).chat:
        chat = config.chat_config()
        command += ["--arrival-rate", str(chat.get("session_rate", ChatConfig().session_rate))]
        command += config_flags({k: v for k, v in chat.items() if k != "seed"}, prefix="chat-")
    return command


def run_locust(
    config: BenchConfig, fleet: Fleet, prefix: Path, total: int, label: str
) -> LocustRun:
    """Locust in its own process (gevent wants one); a progress bar fed by the fleet, whose
    replicas are sampled every second for the charts over time."""
    log = prefix.with_name(prefix.name + "_locust.log")
    psutil.cpu_percent()  # starts the measuring interval
    started = time.monotonic()
    timeline = Timeline(start=time.time())
    samples: list[float] = []
    with (
        open(log, "w") as output,
        tqdm(total=total, desc=label, unit="req", disable=not config.progress) as bar,
        httpx.Client(timeout=5.0, headers=bearer(fleet.token)) as client,
    ):
        process = subprocess.Popen(
            locust_command(config, fleet.gateways, prefix),
            stdout=output,
            stderr=output,
            # the key in the environment, not on a command line others can read
            env={**os.environ, "PR_API_KEY": fleet.api_key},
        )
        seen = _dispatched(client, fleet)
        while process.poll() is None:
            samples.append(psutil.cpu_percent(interval=1.0) / 100)
            replicas = _replicas_now(client, fleet)
            timeline.sample(time.time(), replicas)
            now = _dispatched(client, fleet, replicas)
            bar.update(max(now - seen, 0))
            seen = now
    elapsed = time.monotonic() - started
    if process.returncode not in (0, 1):  # 1: some requests failed, which the row shows
        raise RuntimeError(f"locust exited with {process.returncode}: {log.read_text()[-2000:]}")
    requests, failures = _locust_counts(Path(f"{prefix}_stats.csv"))
    client_figures = json.loads(Path(f"{prefix}_client.json").read_text())
    timeline.add_answers(client_figures.pop("answers", []))
    busy = float(np.mean(samples)) if samples else 0.0
    peak = max(samples, default=0.0)
    return LocustRun(requests, failures, elapsed, client_figures, busy, peak, timeline)


def _replicas_now(client: httpx.Client, fleet: Fleet) -> list[ReplicaStats]:
    """Every replica's stats, or none if one did not answer (a sample is all or nothing)."""
    every = [replica_stats(client, url) for url, config in fleet.replicas.items() if config]
    return [r for r in every if r is not None] if None not in every else []


def _dispatched(client: httpx.Client, fleet: Fleet, replicas: Sequence[ReplicaStats] = ()) -> int:
    """Requests sent so far: our gateways count them; behind another router, the
    replicas do (ours since their reset, vLLM since it started)."""
    if not fleet.ours:
        if replicas:
            return sum(r.requests for r in replicas)
        return sum(f.requests for f in engine_figures(client, fleet).values())
    every = [gateway_stats(client, url) for url in fleet.gateways]
    return sum(b.dispatched for stats in every if stats for b in stats.backends)


def _locust_counts(path: Path) -> tuple[int, int]:
    """Requests and failures of the real requests (not the TTFT and ITL entries)."""
    with open(path, newline="") as stats:
        rows = [r for r in csv.DictReader(stats) if r["Type"] == "POST"]
    return sum(int(r["Request Count"]) for r in rows), sum(int(r["Failure Count"]) for r in rows)
