"""Latency the gateway adds over calling a replica directly.

Starts one replica (simulated time 1000x faster, so the engine's own time is a few
microseconds) and a gateway in front of it, as real processes on loopback, then
sends short non-streamed completions alternately to each and prints p50 and p99 of
both and of the difference. Alternating keeps the machine's noise common to both.
"""

from __future__ import annotations

import argparse
import statistics
import time

import httpx
import numpy as np

from deploy.processes import running


def timed(client: httpx.Client, url: str, body: dict) -> float:
    start = time.perf_counter()
    response = client.post(url + "/v1/completions", json=body)
    elapsed = time.perf_counter() - start
    response.raise_for_status()
    return elapsed


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--requests", type=int, default=1000)
    args = parser.parse_args(argv)
    replica_command = ["replica", "--speedup", "1000"]
    with (
        running(replica_command) as (replica,),
        running(["gateway", f"--backend={replica}", "--policy", "cache_aware"]) as (gateway,),
    ):
        body = {"prompt": "a short question for the fleet", "max_tokens": 1}
        direct, routed = [], []
        with httpx.Client(timeout=30) as client:
            for _ in range(50):  # warm up both paths
                timed(client, replica, body)
                timed(client, gateway, body)
            for _ in range(args.requests):
                direct.append(timed(client, replica, body))
                routed.append(timed(client, gateway, body))
    d, g = np.array(direct) * 1000, np.array(routed) * 1000
    print(f"{args.requests} non-streamed short requests each, alternating (ms):")
    for name, values in (("direct to replica", d), ("through gateway", g)):
        p50, p99 = np.percentile(values, [50, 99])
        print(f"  {name:<18} p50 {p50:6.3f}   p99 {p99:6.3f}")
    added50 = statistics.median(g) - statistics.median(d)
    added99 = float(np.percentile(g, 99) - np.percentile(d, 99))
    print(f"  added by gateway   p50 {added50:6.3f}   p99 {added99:6.3f}   (goal: p50 <= 1 ms)")


if __name__ == "__main__":
    main()
