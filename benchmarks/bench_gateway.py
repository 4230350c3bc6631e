"""What the gateway costs: the latency it adds, and the requests per second it passes.

Starts replicas whose simulated time runs 1000x faster (the engine's own time is a few
microseconds, so what is measured is HTTP and routing) and, as real processes on
loopback, our gateway (``cache_aware``, fed by KV events) and SGLang's router
(``sglang-router``, its ``cache_aware`` policy) in front of the same replicas.

- **Added latency**: short non-streamed completions sent one at a time, alternately
  to a replica and to our gateway; p50 and p99 of both and of the difference.
  Alternating keeps the machine's noise common to both. With ``--prompt-tokens N``,
  chat turns of a conversation whose N-token history the gateway and the replica have
  seen (a new question each), and nothing else: what a long agentic or RAG turn pays.
- **Throughput at saturation**: a closed loop of ``--connections`` clients (one
  asyncio process, keep-alive connections) sends completions for ``--seconds`` to
  each target in turn, for ``--rounds`` rounds: through our gateway, through SGLang's
  router, through vLLM's router (PyPI ``vllm-router``, its ``cache_aware`` policy),
  and straight to the replicas (each client to one replica, as a perfect balancer
  would). Requests per second, median of the rounds, and each target's ratio to
  SGLang's; each router's own CPU time per request (user and system, from ``/proc``,
  over all its processes); the latency it adds at that load (its p50 minus the
  direct p50). Client, router and replicas share this machine's cores, so a router's
  CPU per request is what separates the figures.
- **Where our gateway's CPU goes** (``--profile``): one more round through it under
  py-spy, its samples by stage of the request path (benchmarks/path_profile.py).

The prompts share a few long prefixes (a system prompt per application) and end in
a request-specific question, as a chat fleet's do.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import httpx
import numpy as np
import psutil

from benchmarks import path_profile
from deploy.processes import running
from loadtest.sglang import sglang_router
from loadtest.vllm_router import vllm_router_regular
from replica.api.identity import DEFAULT_MODEL

REPLICA = ["replica", "--speedup", "1000", "--num-blocks", "32768", "--host-blocks", "0"]
APPS = 8
OURS, SGLANG, VLLM, DIRECT = "our gateway", "SGLang's router", "vLLM's router", "direct"


def bodies(count: int) -> list[dict]:
    """Completions with one of ``APPS`` shared ~250-token prefixes and their own
    question, naming the model (SGLang's router requires it)."""
    prefixes = [f"App {a}: you answer questions about product {a}. " * 20 for a in range(APPS)]
    return [
        {"model": DEFAULT_MODEL, "prompt": prefixes[i % APPS] + f"Question {i}?", "max_tokens": 1}
        for i in range(count)
    ]


# ------------------------------------------------------------------ added latency


def timed(client: httpx.Client, url: str, body: dict) -> float:
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    start = time.perf_counter()
    response = client.post(url + path, json=body)
    elapsed = time.perf_counter() - start
    response.raise_for_status()
    return elapsed


def turns(prompt_tokens: int, stream: bool = False) -> Iterator[dict]:
    """A short completion again and again; with ``prompt_tokens``, chat turns on one
    history of about that many tokens (4 bytes each), a new question each."""
    if not prompt_tokens:
        yield from itertools.repeat({"prompt": "a short question for the fleet", "max_tokens": 1})
        return
    history = [
        {"role": role, "content": f"Turn {t}: " + "the quarterly figures, line by line. " * 280}
        for t, role in zip(range(prompt_tokens // 2_500), itertools.cycle(["user", "assistant"]))
    ]
    for question in itertools.count():
        messages = [*history, {"role": "user", "content": f"And question {question}?"}]
        yield {"model": DEFAULT_MODEL, "messages": messages, "max_tokens": 1, "stream": stream}


def added_latency(
    replica: str, gateway: str, requests: int, prompt_tokens: int = 0, stream: bool = False
) -> None:
    direct, routed = [], []
    bodies = turns(prompt_tokens, stream)
    with httpx.Client(timeout=60) as client:
        for _ in range(50):  # warm up both paths (and both caches with the history)
            body = next(bodies)
            timed(client, replica, body)
            timed(client, gateway, body)
        for _ in range(requests):
            body = next(bodies)
            direct.append(timed(client, replica, body))
            routed.append(timed(client, gateway, body))
    d, g = np.array(direct) * 1000, np.array(routed) * 1000
    what = f"{prompt_tokens}-token chat turns" if prompt_tokens else "short requests"
    kind = "streamed" if stream else "non-streamed"
    print(f"Added latency: {requests} {kind} {what} each, alternating (ms):")
    for name, values in (("direct to replica", d), ("through gateway", g)):
        p50, p99 = np.percentile(values, [50, 99])
        print(f"  {name:<18} p50 {p50:6.3f}   p99 {p99:6.3f}")
    added50 = statistics.median(g) - statistics.median(d)
    added99 = float(np.percentile(g, 99) - np.percentile(d, 99))
    print(f"  added by gateway   p50 {added50:6.3f}   p99 {added99:6.3f}   (goal: p50 <= 1 ms)")


# ----------------------------------------------------------------- throughput


@dataclass
class Round:
    """One target's round: requests answered and failed, and each one's seconds."""

    done: int = 0
    failed: int = 0
    latencies: list[float] = field(default_factory=list)


async def saturate(urls: list[str], connections: int, seconds: float) -> Round:
    """``connections`` closed-loop clients for ``seconds``; client ``i`` sends to
    ``urls[i % len(urls)]``."""
    load = bodies(4096)
    result = Round()
    deadline = time.perf_counter() + seconds
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:

        async def client(index: int) -> None:
            url = urls[index % len(urls)] + "/v1/completions"
            for body in itertools.cycle(load[index::connections]):
                start = time.perf_counter()
                if start >= deadline:
                    return
                async with session.post(url, json=body) as response:
                    await response.read()
                    if response.status == 200:
                        result.done += 1
                        result.latencies.append(time.perf_counter() - start)
                    else:
                        result.failed += 1

        await asyncio.gather(*(client(i) for i in range(connections)))
    return result


def listeners(url: str) -> list[psutil.Process]:
    """The processes serving ``url`` (a router's, or its workers sharing the port: whose
    CPU time is measured)."""
    port = int(url.rsplit(":", 1)[1])
    pids = {
        connection.pid
        for connection in psutil.net_connections("tcp")
        if connection.laddr and connection.laddr.port == port and connection.status == "LISTEN"
    }
    if not pids:
        raise RuntimeError(f"nothing listens at {url}")
    return [psutil.Process(pid) for pid in sorted(pid for pid in pids if pid)]


def cpu_s(processes: list[psutil.Process] | None) -> float:
    total = 0.0
    for process in processes or ():
        times = process.cpu_times()
        total += times.user + times.system
    return total


def throughput(
    targets: dict[str, list[str]],
    routers: dict[str, list[psutil.Process]],
    connections: int,
    seconds: float,
    rounds: int,
) -> dict[str, float]:
    """Each target's rounds, interleaved; prints the table, returns each router's
    median CPU seconds per request."""
    for urls in targets.values():  # warm up every path (connections, the router's trees)
        asyncio.run(saturate(urls, connections, 1.0))
    rates: dict[str, list[float]] = {name: [] for name in targets}
    p50s: dict[str, list[float]] = {name: [] for name in targets}
    cpu_per_request: dict[str, list[float]] = {name: [] for name in routers}
    for _ in range(rounds):
        for name, urls in targets.items():
            before = cpu_s(routers.get(name))
            result = asyncio.run(saturate(urls, connections, seconds))
            if result.failed:
                print(f"  warning: {result.failed} requests failed through {name}", file=sys.stderr)
            rates[name].append(result.done / seconds)
            p50s[name].append(statistics.median(result.latencies))
            if name in routers:
                cpu_per_request[name].append((cpu_s(routers[name]) - before) / result.done)
    print(
        f"Throughput at saturation: {connections} closed-loop connections, {rounds} rounds "
        f"of {seconds:.0f} s per target (requests/s, medians; the router's own CPU per "
        "request; its p50 latency minus the direct p50, same round):"
    )
    reference = statistics.median(rates[SGLANG])
    for name, values in rates.items():
        median = statistics.median(values)
        runs = ", ".join(f"{v:,.0f}" for v in values)
        cpu = cpu_per_request.get(name)
        cost = f"   {statistics.median(cpu) * 1e6:4.0f} us CPU/request" if cpu else ""
        added = [p - d for p, d in zip(p50s[name], p50s[DIRECT], strict=True)]
        extra = f"   +{statistics.median(added) * 1e3:.2f} ms p50" if name != DIRECT else ""
        print(
            f"  {name:<20} {median:6,.0f}  ({runs})  {median / reference:.2f}x SGLang's"
            f"{cost}{extra}"
        )
    return {name: statistics.median(values) for name, values in cpu_per_request.items()}


def profiled(gateway: str, connections: int, seconds: float, cpu_per_request: float) -> None:
    """One more round through our gateway under py-spy: where its CPU goes."""
    pids = [process.pid for process in listeners(gateway)]
    out = Path(tempfile.mkdtemp(prefix="gateway-profile-")) / "py-spy"
    spies = path_profile.record(pids, seconds, out)
    asyncio.run(saturate([gateway], connections, seconds + 1.0))
    profile = path_profile.collected(spies, out, pids)
    print(
        f"Our gateway's CPU by stage (py-spy --native, {profile.total} samples over "
        f"{seconds:.0f} s; {cpu_per_request * 1e6:.0f} us a request in the rounds above):"
    )
    print(profile.table())
    print(f"  (raw samples: {out}-PID.txt)")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--requests", type=int, default=1000, help="for the added latency")
    parser.add_argument("--connections", type=int, default=32)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--prompt-tokens",
        type=int,
        default=0,
        help="measure only the latency added to chat turns of this long a seen history",
    )
    parser.add_argument("--stream", action="store_true", help="with --prompt-tokens: streamed")
    parser.add_argument(
        "--workers", type=int, default=1, help="our gateway's processes (gateway --workers)"
    )
    parser.add_argument(
        "--profile", action="store_true", help="then profile our gateway by stage (py-spy)"
    )
    args = parser.parse_args(argv)
    if args.prompt_tokens:
        with (
            running(REPLICA) as (replica,),
            running(["gateway", f"--backend={replica}"]) as (gateway,),
        ):
            added_latency(replica, gateway, args.requests, args.prompt_tokens, args.stream)
        return
    with running(*[REPLICA] * args.replicas) as replicas:
        backends = [f"--backend={url}" for url in replicas]
        with (
            running(
                ["gateway", *backends, "--policy", "cache_aware", "--workers", str(args.workers)]
            ) as (gateway,),
            sglang_router(replicas) as sglang,
            vllm_router_regular(replicas) as vllm,
        ):
            added_latency(replicas[0], gateway, args.requests)
            targets = {OURS: [gateway], SGLANG: [sglang], VLLM: [vllm], DIRECT: replicas}
            routers = {name: listeners(urls[0]) for name, urls in targets.items() if name != DIRECT}
            cpu = throughput(targets, routers, args.connections, args.seconds, args.rounds)
            if args.profile:
                profiled(gateway, args.connections, args.seconds, cpu[OURS])


if __name__ == "__main__":
    main()
