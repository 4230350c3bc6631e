"""`prefix-router serve --engine vllm`: vLLM servers owned by Ray actors, the gateway
configured from what they say of themselves, the OpenAI client end to end, and a vLLM
server killed mid-load: its requests retried, itself removed, restarted by its actor
and re-admitted. Nothing is left behind: no process, no file in the temporary folder."""

import asyncio
import os
import signal

import httpx
import openai
import psutil
import pytest

from deploy import processes
from tests.shared import (
    VLLM_ARGS,
    gateway_stats,
    vllm_processes,
    vllm_work_folders,
    wait_for,
    wait_until_checked,
)

pytestmark = [pytest.mark.slow, pytest.mark.ray, pytest.mark.vllm]


def api_server(process: psutil.Process) -> bool:
    return process.info["cmdline"][1:3] == ["-m", "vllm.entrypoints.openai.api_server"]


def server_on(url: str) -> psutil.Process:
    port = url.rsplit(":", 1)[1]
    (process,) = [p for p in vllm_processes() if api_server(p) and port in p.info["cmdline"]]
    return process


async def load(url: str, model: str, rate: float, seconds: float) -> list[int]:
    """Open loop, non-streamed, every request a conversation of its own."""

    async def one(client: httpx.AsyncClient, i: int) -> int:
        body = {"model": model, "prompt": f"Conversation {i}. " * 120, "max_tokens": 24}
        return (await client.post(f"{url}/v1/completions", json=body)).status_code

    async with httpx.AsyncClient(timeout=120) as client:
        tasks = []
        for i in range(int(rate * seconds)):
            tasks.append(asyncio.create_task(one(client, i)))
            await asyncio.sleep(1 / rate)
        return list(await asyncio.gather(*tasks))


def test_serve_engine_vllm_end_to_end_and_a_killed_server_comes_back(tiny_model, tmp_path):
    before = {p.pid for p in vllm_processes()}
    folders = vllm_work_folders()
    port = processes.free_port()
    command = ["serve", "--engine", "vllm", "--model", str(tiny_model), "--replicas", "2",
               "--stride", "1", "--engine-arg", " ".join(VLLM_ARGS)]  # fmt: skip
    with open(tmp_path / "serve.log", "w") as log:
        process = processes.start(command, port, stderr=log)
    url, model = f"http://127.0.0.1:{port}", str(tiny_model)
    try:
        processes.wait_until(url, process, timeout_s=300)
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

        victim = stats.backends[0]
        server = server_on(victim.url)

        async def chaos() -> tuple[list[int], bool]:
            killed, removed = asyncio.Event(), False

            async def kill_later() -> None:
                await asyncio.sleep(2.0)
                os.kill(server.pid, signal.SIGKILL)  # as the kernel's OOM killer would
                killed.set()

            async def watch() -> None:  # until the load ends, or it is seen removed
                nonlocal removed
                await killed.wait()
                async with httpx.AsyncClient(timeout=10) as stats_client:
                    while not removed:
                        backends = (await stats_client.get(f"{url}/stats")).json()["backends"]
                        removed = not any(
                            b["healthy"] and b["replica_id"] == victim.replica_id for b in backends
                        )
                        await asyncio.sleep(0.1)

            watcher = asyncio.create_task(watch())
            statuses, _ = await asyncio.gather(load(url, model, 8, 8), kill_later())
            await asyncio.wait_for(watcher, 30)
            return statuses, removed

        statuses, removed = asyncio.run(chaos())
        assert statuses.count(200) == len(statuses)  # every request retried elsewhere
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
        answer = httpx.post(f"{victim.url}/v1/completions", json=body, timeout=60)
        assert answer.status_code == 200, f"re-admitted after {back:.0f} s"
    finally:
        processes.stop(process, timeout_s=60)
    assert process.returncode == 0, (tmp_path / "serve.log").read_text()[-3000:]
    wait_for(lambda: {p.pid for p in vllm_processes()} <= before, 30, "every vLLM server stopped")
    assert vllm_work_folders() <= folders  # their work folders removed
