"""What a routing decision costs inside Ray Serve: ours beside Serve's default router
and Ray Serve LLM's, on the same application (deploy/ray_serve/).

    python -m benchmarks.bench_serve_router [--requests 300] [--rounds 3]

A local Ray with Serve; for each router in turn (in each of ``--rounds`` rounds, so
that the machine's drift falls on all of them alike), our application of
``--replicas`` engines made fast (``speedup 1000``: an answer's engine time is
negligible), then ``--requests`` completions one after another, each a 1,024-token
shared prefix and a fresh suffix, one token out. Per router, medians over the rounds:

- the latency of a request through Serve (proxy, ingress, the router, the engine);
- the ingress process's CPU per request (user and system, from ``/proc``): the
  handle's request router runs there, beside the ingress's own work, which is the
  same for every router;
- both minus Serve's default router's: what the router adds.
"""

from __future__ import annotations

import argparse
import statistics
import time

import httpx
import psutil
import ray
from ray import serve

from deploy.local import start_local_ray
from deploy.processes import free_port
from deploy.ray_serve.app import build_app
from deploy.ray_serve.config import INGRESS

ROUTERS = ("pow2", "prefix_affinity", "prefix")
PREFIX = "shared prefix words " * 205  # 1,024 tokens of the simulated tokenizer (4 bytes each)
APP = "bench-serve-router"


def ingress_process() -> psutil.Process:
    """The ingress replica's process (Ray titles it after the deployment)."""
    for process in psutil.process_iter(["cmdline"]):
        if any(INGRESS in part for part in process.info["cmdline"] or []):
            return process
    raise RuntimeError("no ingress replica process found")


def cpu_s(process: psutil.Process) -> float:
    times = process.cpu_times()
    return times.user + times.system


def one_round(url: str, router: str, replicas: int, requests: int) -> tuple[float, float, float]:
    """p50 and p90 latency (s) and the ingress's CPU per request (s), for ``router``."""
    args = {"replicas": replicas, "router": router, "engine": {"speedup": 1000.0}}
    serve.run(build_app(args), name=APP, route_prefix="/")
    latencies = []
    with httpx.Client(base_url=url, timeout=60) as client:
        for i in range(20):  # the router made, the engines checked, connections open
            client.post("/v1/completions", json={"prompt": f"warm {i}", "max_tokens": 1})
        ingress = ingress_process()
        before = cpu_s(ingress)
        for i in range(requests):
            body = {"prompt": f"{PREFIX}question {i}", "max_tokens": 1}
            start = time.perf_counter()
            answer = client.post("/v1/completions", json=body)
            latencies.append(time.perf_counter() - start)
            answer.raise_for_status()
        cpu = (cpu_s(ingress) - before) / requests
    serve.delete(APP)
    latencies.sort()
    return statistics.median(latencies), latencies[int(0.9 * len(latencies))], cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--replicas", type=int, default=4)
    args = parser.parse_args()
    start_local_ray(num_cpus=2)
    port = free_port()
    figures: dict[str, list[tuple[float, float, float]]] = {r: [] for r in ROUTERS}
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        for round_ in range(args.rounds):
            for router in ROUTERS:
                url = f"http://127.0.0.1:{port}"
                figures[router].append(one_round(url, router, args.replicas, args.requests))
                p50, p90, cpu = figures[router][-1]
                print(
                    f"round {round_ + 1} {router}: p50 {p50 * 1e3:.2f} ms, "
                    f"p90 {p90 * 1e3:.2f} ms, ingress CPU {cpu * 1e6:.0f} us/request",
                    flush=True,
                )
    finally:
        serve.shutdown()
        ray.shutdown()
    base_p50 = statistics.median(f[0] for f in figures["pow2"])
    base_cpu = statistics.median(f[2] for f in figures["pow2"])
    print(
        "\n| router | latency p50 | p90 | added p50 | ingress CPU per request | added CPU |"
        "\n|---|---:|---:|---:|---:|---:|"
    )
    for router, rounds in figures.items():
        p50 = statistics.median(f[0] for f in rounds)
        p90 = statistics.median(f[1] for f in rounds)
        cpu = statistics.median(f[2] for f in rounds)
        print(
            f"| {router} | {p50 * 1e3:.2f} ms | {p90 * 1e3:.2f} ms | "
            f"{(p50 - base_p50) * 1e3:+.2f} ms | {cpu * 1e6:.0f} us | "
            f"{(cpu - base_cpu) * 1e6:+.0f} us |"
        )


if __name__ == "__main__":
    main()
