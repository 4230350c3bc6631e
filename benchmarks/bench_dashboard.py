"""What the dashboard costs the gateway: CPU and bytes per refresh, and whether the
latency the gateway adds moves while the page is open.

Starts ``--replicas`` replicas (simulated time 1000x faster, with a host tier) and a
``cache_aware`` gateway as real processes on loopback, as ``bench_gateway`` does,
and sends traffic through it (``bench_gateway``'s prompts: shared application
prefixes, so there are hot prefixes to show). Then:

- **Refresh cost**: ``--refreshes`` calls of ``/dashboard/data`` one after another,
  each asking for the chart points since the last (as the page does): the gateway
  process's CPU time per refresh (psutil), the bytes of an answer, and those of a
  first load (``since=0``, the whole history kept so far).
- **Added latency with the page open**: short non-streamed completions, one at a
  time, alternately to a replica and through the gateway (``bench_gateway``'s
  method), in blocks with no page, with a poller refreshing as the page does
  (every 2 s), and with one refreshing 20 times as often; blocks interleaved so
  the machine's drift is common to all.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import numpy as np

from benchmarks.bench_gateway import bodies, cpu_s, listeners, saturate, timed
from deploy.processes import running

REPLICA = ["replica", "--speedup", "1000", "--num-blocks", "4096", "--host-blocks", "8192"]


def refresh_cost(gateway: str, refreshes: int) -> None:
    process = listeners(gateway)
    with httpx.Client(timeout=30) as client:
        first = client.get(f"{gateway}/dashboard/data").content
        since, sizes = 0.0, []
        before, start = cpu_s(process), time.perf_counter()
        for _ in range(refreshes):
            answer = client.get(f"{gateway}/dashboard/data", params={"since": since})
            since = answer.json()["ts"]
            sizes.append(len(answer.content))
        cpu, wall = cpu_s(process) - before, time.perf_counter() - start
    print(f"Refresh cost over {refreshes} refreshes (the gateway process):")
    print(f"  CPU per refresh      {cpu / refreshes * 1e3:6.2f} ms")
    print(f"  wall per refresh     {wall / refreshes * 1e3:6.2f} ms (replicas' /stats included)")
    print(f"  bytes per refresh    {statistics.median(sizes):6,.0f} (median; points since last)")
    print(f"  bytes of first load  {len(first):6,} (the whole history kept so far)")


@contextmanager
def polling(gateway: str, interval_s: float | None) -> Iterator[None]:
    """A page refreshing every ``interval_s`` (``None``: no page) while the block runs."""
    stop = threading.Event()

    def poll() -> None:
        since = 0.0
        with httpx.Client(timeout=30) as client:
            while not stop.wait(interval_s):
                answer = client.get(f"{gateway}/dashboard/data", params={"since": since})
                since = answer.json()["ts"]

    thread = threading.Thread(target=poll, daemon=True) if interval_s else None
    if thread is not None:
        thread.start()
    try:
        yield
    finally:
        stop.set()
        if thread is not None:
            thread.join()


def added_latency(replica: str, gateway: str, requests: int, blocks: int) -> None:
    body = {"prompt": "a short question for the fleet", "max_tokens": 1}
    modes: dict[str, float | None] = {
        "no page": None,
        "page, every 2 s": 2.0,
        "page, every 0.1 s": 0.1,
    }
    direct: dict[str, list[float]] = {mode: [] for mode in modes}
    routed: dict[str, list[float]] = {mode: [] for mode in modes}
    with httpx.Client(timeout=30) as client:
        for _ in range(50):  # warm up both paths
            timed(client, replica, body), timed(client, gateway, body)
        for _ in range(blocks):
            for mode, interval in modes.items():
                with polling(gateway, interval):
                    for _ in range(requests):
                        direct[mode].append(timed(client, replica, body))
                        routed[mode].append(timed(client, gateway, body))
    print(f"Added latency, {blocks} interleaved blocks of {requests} requests per mode (ms):")
    for mode in modes:
        d, g = np.array(direct[mode]) * 1e3, np.array(routed[mode]) * 1e3
        added50 = float(np.median(g) - np.median(d))
        added99 = float(np.percentile(g, 99) - np.percentile(d, 99))
        print(
            f"  {mode:<18} added p50 {added50:6.3f}   p99 {added99:6.3f}"
            f"   (gateway p50 {np.median(g):6.3f}, p99 {np.percentile(g, 99):6.3f})"
        )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--replicas", type=int, default=8)
    parser.add_argument("--refreshes", type=int, default=200)
    parser.add_argument("--requests", type=int, default=500, help="per block and mode")
    parser.add_argument("--blocks", type=int, default=4)
    args = parser.parse_args(argv)
    with running(*[REPLICA] * args.replicas) as replicas:
        backends = [f"--backend={url}" for url in replicas]
        with running(["gateway", *backends, "--policy", "cache_aware"]) as (gateway,):
            asyncio.run(saturate([gateway], 16, 3.0))  # counters, caches, hot prefixes
            for _ in range(5):  # a few samples of history, as an open page leaves
                httpx.get(f"{gateway}/dashboard/data")
                asyncio.run(saturate([gateway], 8, 1.0))
            print(f"{args.replicas} replicas, {len(bodies(1))} traffic warm-up done")
            refresh_cost(gateway, args.refreshes)
            added_latency(replicas[0], gateway, args.requests, args.blocks)


if __name__ == "__main__":
    main()
