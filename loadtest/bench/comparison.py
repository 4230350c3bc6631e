"""The comparison: every policy in turn, one row each, with the replay's view."""

from __future__ import annotations

import sys
from pathlib import Path

import httpx

from loadtest import ray_serve, sglang, vllm_router
from loadtest.bench.config import BenchConfig
from loadtest.bench.locust_run import LocustRun, run_locust
from loadtest.bench.prediction import add_prediction, predict
from loadtest.bench.prepare import reset, switch_policy
from loadtest.bench.rows import live_row, snapshot
from loadtest.bench.targets import Fleet, discover, replica_config
from loadtest.report import Row
from loadtest.timeline import Timeline
from loadtest.workloads import Workload
from replica.api.fleet_token import bearer


def compare(
    config: BenchConfig, gateways: list[str], out: Path, fleet_token: str = ""
) -> tuple[list[Row], Fleet, dict[str, Timeline]]:
    """Every policy in turn against ``gateways`` (whose replicas ask ``fleet_token`` of
    callers); one row each, with the replay's view, and each run's timeline."""
    out.mkdir(parents=True, exist_ok=True)
    workload = config.load()
    with httpx.Client(timeout=30.0, headers=bearer(fleet_token)) as client:
        fleet = discover(client, gateways, fleet_token)
        check_target(config, fleet)
        announce(fleet)
        rows, timelines = [], {}
        for label in config.policies:
            if label == sglang.LABEL and fleet.ours:  # else the target is theirs already
                row, run = run_behind_sglang(client, config, fleet, workload, out)
            elif label == vllm_router.LABEL and fleet.ours:
                row, run = run_behind_vllm_router(client, config, fleet, workload, out)
            elif ray_serve.is_serve(label):
                row, run = run_in_ray_serve(client, config, fleet, label, workload, out)
            else:
                row, run = run_policy(client, config, fleet, label, workload, out)
            rows.append(row)
            timelines[label] = run.timeline
    for row in rows:
        predicted = predict(config, fleet, row["label"], workload) if config.predict else None
        add_prediction(row, predicted)
    return rows, fleet, timelines


def check_target(config: BenchConfig, fleet: Fleet) -> None:
    if not fleet.ours and len(config.policies) > 1:
        raise ValueError(
            f"{', '.join(fleet.gateways)}: not a prefix-router gateway, so the bench cannot "
            "switch its policy: pass one --policies NAME, a label for how it routes"
        )


def announce(fleet: Fleet) -> None:
    """Where to watch the run live: each of our gateways serves its dashboard."""
    for gateway in fleet.gateways if fleet.ours else []:
        print(f"bench: live dashboard at {gateway}/dashboard", file=sys.stderr)


def run_policy(
    client: httpx.Client,
    config: BenchConfig,
    fleet: Fleet,
    label: str,
    workload: Workload,
    out: Path,
) -> tuple[Row, LocustRun]:
    """One live run: empty every cache, switch our gateways (if ours), play the workload."""
    if not reset(client, fleet):
        print(
            f"warning: could not reset every replica's cache before {label} (a vLLM "
            "server needs --vllm-dev-mode for its /reset_prefix_cache)",
            file=sys.stderr,
        )
    if fleet.ours:
        switch_policy(client, fleet, label)
    before = snapshot(client, fleet)
    run = run_locust(config, fleet, out / label, workload.num_requests, label)
    return live_row(label, config, fleet, run, before, snapshot(client, fleet)), run


def run_behind_sglang(
    client: httpx.Client, config: BenchConfig, fleet: Fleet, workload: Workload, out: Path
) -> tuple[Row, LocustRun]:
    """The same run with SGLang's router in front of the same replicas, started for
    this row and stopped after it (an error included)."""
    workers = list(fleet.replicas)
    print(f"bench: starting SGLang's router in front of {len(workers)} replicas…", file=sys.stderr)
    log = out / f"{sglang.LABEL}.log"
    with sglang.sglang_router(workers, log=log, api_key=fleet.token) as router:
        return run_policy(client, config, fleet.behind(router), sglang.LABEL, workload, out)


def run_behind_vllm_router(
    client: httpx.Client, config: BenchConfig, fleet: Fleet, workload: Workload, out: Path
) -> tuple[Row, LocustRun]:
    """The same run with vLLM's router in P/D mode in front of the same prefill and
    decode replicas, started for this row and stopped after it."""
    prefill, decode = fleet.by_role("prefill"), fleet.by_role("decode")
    print(
        f"bench: starting vLLM's router (P/D) in front of {len(prefill)} prefill and "
        f"{len(decode)} decode replicas…",
        file=sys.stderr,
    )
    log = out / f"{vllm_router.LABEL}.log"
    with vllm_router.vllm_router(prefill, decode, log=log, api_key=fleet.token) as router:
        return run_policy(client, config, fleet.behind(router), vllm_router.LABEL, workload, out)


def run_in_ray_serve(
    client: httpx.Client,
    config: BenchConfig,
    fleet: Fleet,
    label: str,
    workload: Workload,
    out: Path,
) -> tuple[Row, LocustRun]:
    """The same run through a Ray Serve application of as many engines, configured as
    the fleet's replicas are, started for this row and stopped after it
    (loadtest/ray_serve.py)."""
    engines = [c for c in fleet.replicas.values() if c]
    vllm = fleet.stats is not None and {b.engine for b in fleet.stats.backends} == {"vllm"}
    if fleet.stats is None or not (vllm or len(engines) == len(fleet.replicas)):
        raise ValueError(
            f"{label}: a Ray Serve row runs engines like the bench's own replicas, "
            "simulated or vLLM (an embedded deployment, or our gateway in front of them)"
        )
    count, gateway = len(fleet.replicas), fleet.stats.config
    app: ray_serve.ServeApp | ray_serve.ServeLLMApp
    if vllm:
        app = ray_serve.llm_application(label, count, gateway)
        what = "Ray Serve LLM with {} vLLM replicas"
    else:
        app = ray_serve.application(label, engines[0], count, gateway)
        what = "Ray Serve with {} engines"
    print(f"bench: starting {what.format(count)} for {label}…", file=sys.stderr)
    with ray_serve.running(app, out / label / "serve") as (url, engine_urls):
        served = Fleet([url], None, {u: replica_config(client, u) for u in engine_urls})
        return run_policy(client, config, served, label, workload, out)
