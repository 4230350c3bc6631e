"""`prefix-router serve --engine vllm`: vLLM servers owned by Ray actors, the gateway
configured from what they say of themselves, the OpenAI client end to end, `bench`'s
three routers in front of them, and a vLLM server killed mid-load: its requests
retried, itself removed, restarted by its actor and re-admitted. Nothing is left
behind: no process, no file in the temporary folder. One deployment for all of it: a
CPU vLLM server takes most of a minute to start."""

import asyncio
import os
import signal
from dataclasses import replace
from pathlib import Path

import httpx
import openai
import psutil
import pytest

from replica.api.cost_model import PROFILES
from replica.api.fleet_token import ENV_FLEET_TOKEN, bearer
from router.stats import BackendStats
from tests.loadtest.test_bench import TINY_ON_A_CORE, bench, check_report
from tests.shared import (
    VLLM_ARGS,
    gateway_stats,
    leaves_no_vllm_behind,
    logged_process,
    vllm_processes,
    wait_for,
    wait_until_checked,
)

pytestmark = [pytest.mark.slow, pytest.mark.ray, pytest.mark.vllm]

TOKEN = "the-fleets-token"
#: vLLM's endpoints a caller without the fleet's token is refused (dev mode's among them).
GUARDED = [
    ("POST", "/v1/completions"),
    ("POST", "/v1/chat/completions"),
    ("GET", "/v1/models"),
    ("POST", "/tokenize"),
    ("GET", "/metrics"),
    ("POST", "/reset_prefix_cache"),
    ("GET", "/load"),
    ("GET", "/version"),
]


def api_server(process: psutil.Process) -> bool:
    return process.info["cmdline"][1:3] == ["-m", "vllm.entrypoints.openai.api_server"]


def server_on(url: str) -> psutil.Process:
    port = url.rsplit(":", 1)[1]
    (process,) = [p for p in vllm_processes() if api_server(p) and port in p.info["cmdline"]]
    return process


async def load(url: str, model: str, rate: float, seconds: float) -> list[int | str]:
    """Open loop, non-streamed, every request a conversation of its own: each one's
    status, or the name of the error that ended it (a timeout, a dropped connection)."""

    async def one(client: httpx.AsyncClient, i: int) -> int | str:
        body = {"model": model, "prompt": f"Conversation {i}. " * 120, "max_tokens": 24}
        try:
            return (await client.post(f"{url}/v1/completions", json=body)).status_code
        except httpx.HTTPError as error:
            return type(error).__name__

    async with httpx.AsyncClient(timeout=120) as client:
        tasks = []
        for i in range(int(rate * seconds)):
            tasks.append(asyncio.create_task(one(client, i)))
            await asyncio.sleep(1 / rate)
        return list(await asyncio.gather(*tasks))


async def kill_mid_load(
    url: str, model: str, victim: BackendStats, pid: int
) -> tuple[list[int | str], bool]:
    """Eight seconds of load at eight requests a second, with ``victim``'s vLLM server
    (process ``pid``) killed two seconds in: each request's outcome, and whether the
    gateway was seen to remove the victim before the load ended."""
    killed, removed = asyncio.Event(), False

    async def kill_later() -> None:
        await asyncio.sleep(2.0)
        os.kill(pid, signal.SIGKILL)  # as the kernel's OOM killer would
        killed.set()

    async def watch() -> None:  # until the load ends, or it is seen removed
        nonlocal removed
        await killed.wait()
        async with httpx.AsyncClient(timeout=10) as stats_client:
            while not removed:
                try:  # a busy machine may answer slowly: not what is tested here
                    stats = (await stats_client.get(f"{url}/stats")).json()
                except httpx.TimeoutException:
                    continue
                removed = not any(
                    b["healthy"] and b["replica_id"] == victim.replica_id for b in stats["backends"]
                )
                await asyncio.sleep(0.1)

    watcher = asyncio.create_task(watch())
    statuses, _ = await asyncio.gather(load(url, model, 8, 8), kill_later())
    await asyncio.wait_for(watcher, 30)
    return statuses, removed


def compare_routers(url: str, model: Path, out: Path, token_file: Path) -> None:
    """`make demo-vllm` in small: SGLang's router and ours, each in front of the same
    two vLLM servers, hits counted by vLLM itself and by its answers; beside each, the
    replay of the same workload, as the model's tokenizer reads it, on twins timed by a
    calibrated profile with vLLM's pool. (Round robin's row takes the path ours does:
    left to the demo, for the suite's time.)"""
    policies = ["sglang_router", "cache_aware"]
    profile = out.with_suffix(".profile.json")
    replace(PROFILES["llama3-8b-h100"], costs=TINY_ON_A_CORE, kv_tokens=8192).save(profile)
    target = ["--gateway", url, "--model", str(model), "--fleet-token-file", str(token_file)]
    done = bench(out, *target, "--policies", ",".join(policies), "--replay-profile", str(profile))
    assert done.returncode == 0, done.stderr[-3000:]
    rows = check_report(out, policies)
    theirs, ours = rows
    assert ours["prediction_exact"] >= 0.95 and ours["prediction_over"] <= 0.05
    assert theirs["prediction_exact"] is None  # SGLang's router predicts nothing we see
    assert all(r["replicas"] == 2 or r["policy"] is None for r in rows)


def test_serve_engine_vllm_end_to_end_and_a_killed_server_comes_back(tiny_model, tmp_path):
    model, log = str(tiny_model), tmp_path / "serve.log"
    engine = ["--engine", "vllm", "--model", model, "--engine-arg", " ".join(VLLM_ARGS)]
    # dev mode: bench empties the servers' caches between its runs (/reset_prefix_cache)
    command = ["serve", *engine, "--replicas", "2", "--stride", "1", "--vllm-dev-mode"]
    token_file = tmp_path / "fleet-token"
    token_file.write_text(TOKEN)
    operators = {ENV_FLEET_TOKEN: TOKEN}  # the fleet's token: serve's replicas ask it
    with leaves_no_vllm_behind():
        with logged_process(command, log, 300, 60, operators) as (url, process):
            stats = wait_until_checked(url, 2)
            # The gateway configured itself from the engines: their block size and model.
            assert (stats.config.routing.block_size, stats.config.model) == (32, model)
            assert [(b.engine, b.routing_mode) for b in stats.backends] == [("vllm", "precise")] * 2

            client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
            assert [m.id for m in client.models.list().data] == [model]
            system = {"role": "system", "content": "You are a careful assistant. " * 80}
            replies = [
                client.chat.completions.with_raw_response.create(
                    model=model, messages=[system, {"role": "user", "content": q}], max_tokens=4
                )
                for q in ("What is a KV cache?", "And a prefix cache?")
            ]
            cached = [r.parse().usage.prompt_tokens_details.cached_tokens for r in replies]
            assert cached[0] == 0 and cached[1] > 400
            assert int(replies[1].headers["x-prefix-router-predicted-cached-tokens"]) == cached[1]

            compare_routers(url, tiny_model, tmp_path / "bench", token_file)

            victim = stats.backends[0]
            # vLLM's server answers only the fleet's token on every path but /health
            # (its own --api-key guards /v1 alone; our guard the rest)
            assert httpx.get(f"{victim.url}/health").status_code == 200
            for method, path in GUARDED:
                assert httpx.request(method, victim.url + path, json={}).status_code == 401, path
            carried = httpx.get(f"{victim.url}/metrics", headers=bearer(TOKEN))
            assert carried.status_code == 200 and "vllm:" in carried.text
            server = server_on(victim.url)
            statuses, removed = asyncio.run(kill_mid_load(url, model, victim, server.pid))
            # Every request retried elsewhere.
            assert statuses.count(200) == len(statuses), (statuses, gateway_stats(url).retries)
            assert gateway_stats(url).retries > 0
            # Removed (its circuit open, or its actor not answering while it restarts the
            # server), then restarted on the same port and re-admitted.
            assert removed

            def readmitted() -> bool:
                return any(
                    b.healthy and b.url == victim.url and b.routing_mode == "precise"
                    for b in gateway_stats(url).backends
                )

            back = wait_for(readmitted, 180, "the killed server restarted and re-admitted")
            assert server_on(victim.url).pid != server.pid
            body = {"model": model, "prompt": "back?", "max_tokens": 2}
            answer = httpx.post(
                f"{victim.url}/v1/completions", json=body, headers=bearer(TOKEN), timeout=60
            )
            assert answer.status_code == 200, f"re-admitted after {back:.0f} s"
        assert process.returncode == 0, log.read_text()[-3000:]
