"""Overload: at about three times what the fleet can take, the gateway admits what it
can with a bounded latency, refuses the rest with 429, holds its memory, recovers."""

import asyncio
import re
import time

import httpx
import numpy as np
import pytest

from deploy.processes import running

pytestmark = pytest.mark.slow

QUEUE_TIMEOUT_S = 1.0


async def offer(url: str, rate: float, seconds: float) -> list[tuple[int, float, str | None]]:
    """Open loop: a request every 1/rate s whatever the answers' pace; (status, s, Retry-After)."""
    body = {"prompt": "Tell me about prefix caches. " * 30, "max_tokens": 48, "ignore_eos": True}

    async def one(client: httpx.AsyncClient) -> tuple[int, float, str | None]:
        start = time.monotonic()
        response = await client.post(f"{url}/v1/completions", json=body)
        return response.status_code, time.monotonic() - start, response.headers.get("retry-after")

    limits = httpx.Limits(max_connections=1000, max_keepalive_connections=1000)
    async with httpx.AsyncClient(timeout=60, limits=limits) as client:
        tasks = []
        for _ in range(int(rate * seconds)):
            tasks.append(asyncio.create_task(one(client)))
            await asyncio.sleep(1 / rate)
        return await asyncio.gather(*tasks)


def gateway_figure(url: str, name: str) -> float:
    found = re.search(rf"^{name} (\S+)$", httpx.get(f"{url}/metrics").text, re.MULTILINE)
    assert found, name
    return float(found.group(1))


def test_three_times_the_capacity_gets_429s_not_an_unbounded_queue():
    # One replica in real time: a request takes about 0.4 s; 4 at a time, 8 waiting.
    with running(["replica", "--speedup", "1"]) as (replica,):
        limits = ["--max-outstanding-per-replica", "4", "--max-queued", "8"]
        timeout = ["--queue-timeout-s", str(QUEUE_TIMEOUT_S)]
        gateway = ["gateway", f"--backend={replica}", *limits, *timeout]
        with running(gateway) as (url,):
            calm = asyncio.run(offer(url, rate=4, seconds=3))  # within capacity: all served
            memory_before = gateway_figure(url, "process_resident_memory_bytes")
            waves = [asyncio.run(offer(url, rate=30, seconds=4)) for _ in range(2)]
            memory_after = gateway_figure(url, "process_resident_memory_bytes")
            recovered = asyncio.run(offer(url, rate=4, seconds=2))
            stats = httpx.get(f"{url}/stats").json()
            queued = gateway_figure(url, "prefix_router_queued_requests")
    assert all(status == 200 for status, _, _ in calm + recovered)
    for wave in waves:
        served = [seconds for status, seconds, _ in wave if status == 200]
        refused = [retry for status, _, retry in wave if status == 429]
        assert len(served) + len(refused) == len(wave)  # no 5xx, no hang
        assert len(served) >= 10 and len(refused) >= len(wave) // 3
        assert all(retry is not None and int(retry) >= 1 for retry in refused)
        # Admitted requests waited at most the queue timeout, then were served.
        assert np.percentile(served, 99) < QUEUE_TIMEOUT_S + 3.0
    assert memory_after - memory_before < 20e6  # flat: 240 requests, nothing held
    assert queued == 0 and all(b["outstanding_requests"] == 0 for b in stats["backends"])
    print(
        f"overload: {sum(len(w) for w in waves)} sent, "
        f"{sum(s == 200 for w in waves for s, _, _ in w)} served, "
        f"{sum(s == 429 for w in waves for s, _, _ in w)} refused with 429, served p99 "
        f"{max(np.percentile([t for s, t, _ in w if s == 200], 99) for w in waves):.2f} s, "
        f"gateway RSS {memory_before / 1e6:.1f} -> {memory_after / 1e6:.1f} MB"
    )


def test_a_gateway_told_to_stop_finishes_its_streams_first():
    import json
    import signal

    from deploy import processes

    with running(["replica", "--speedup", "1"]) as (replica,):
        port = processes.free_port()
        gateway = processes.start(["gateway", f"--backend={replica}"], port)
        url = f"http://127.0.0.1:{port}"
        try:
            processes.wait_until(url, gateway)
            body = {"prompt": "Stream me. " * 20, "max_tokens": 120, "ignore_eos": True}
            with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}) as r:
                lines = r.iter_lines()
                first = next(line for line in lines if line.startswith("data: {"))
                gateway.send_signal(signal.SIGTERM)  # mid-stream
                rest = [line for line in lines if line.startswith("data: ")]
            assert json.loads(first[6:])["choices"][0]["text"]
            assert rest[-1] == "data: [DONE]" and len(rest) >= 120  # every token, then done
            assert gateway.wait(timeout=30) in (0, -signal.SIGTERM)  # uvicorn re-raises it
            with pytest.raises(httpx.ConnectError):  # and it accepts nothing new
                httpx.post(f"{url}/v1/completions", json=body)
        finally:
            processes.stop(gateway)
