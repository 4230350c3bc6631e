"""An engine that evicts without telling: the gateway's predictions before and after.

    python -m benchmarks.bench_silent_eviction [--prompts 16] [--rounds 4] [--clients 4]

One simulated replica runs in this process (so that its publisher can withhold a batch)
behind a ``prefix-router gateway`` subprocess. Each of ``--prompts`` prompts is asked
once, cold; then ``--rounds`` rounds ask each again, ``--clients`` at a time. Then the
engine empties its cache and the batch that says so is withheld (the engine evicts
without telling), and ``--rounds`` more rounds follow. A prediction is exact when the
gateway's predicted cached tokens equal the engine's ``cached_tokens``, as the gateway's
``/stats`` counts ``exact_predictions``; printed before the eviction, in the first round
after it (where each prompt's first answer finds it gone) and in the rounds after that,
with the gateway's counts of event disagreements, decision corrections, replayed
batches and resyncs.

``--gateway-tree DIR`` runs the gateway from another checkout (put first on its
``PYTHONPATH``): the same scenario before a change to the gateway.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
from collections import Counter

import httpx

from deploy import processes
from deploy.serving import serve_in_loop
from replica.api.config import ReplicaConfig
from replica.server import create_app
from replica.service import Replica


def prompt(i: int) -> list[int]:
    """Prompt ``i``: 207 to 911 tokens, sharing nothing with the others; what the engine
    can hold of it ends on a router stride (64 tokens), so a prediction can be exact."""
    return [i * 10_000 + t for t in range(1, 64 * (3 + i % 12) + 16)]


def start_gateway(backend: str, port: int, tree: str) -> subprocess.Popen:
    """``prefix-router gateway`` in front of ``backend``, from the checkout ``tree`` if
    given (its working directory too: ``python -m`` puts that first on the path)."""
    command = [sys.executable, "-m", "prefix_router", "gateway", f"--backend={backend}"]
    return subprocess.Popen(
        [*command, "--port", str(port)],
        cwd=tree or None,
        env={**os.environ, "PYTHONPATH": tree} if tree else None,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )


async def ask(client: httpx.AsyncClient, gateway: str, i: int) -> str:
    """``exact``, ``over`` or ``under``: the gateway's prediction against the engine."""
    body = {"prompt": prompt(i), "max_tokens": 2}
    answer = await client.post(f"{gateway}/v1/completions", json=body, timeout=60)
    answer.raise_for_status()
    predicted = int(answer.headers["x-prefix-router-predicted-cached-tokens"])
    cached = answer.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    return "exact" if predicted == cached else "over" if predicted > cached else "under"


async def rounds(
    client: httpx.AsyncClient, gateway: str, args: argparse.Namespace
) -> list[Counter[str]]:
    """``args.rounds`` rounds over every prompt, ``args.clients`` requests at a time: the
    outcomes of each round."""
    slots = asyncio.Semaphore(args.clients)

    async def one(i: int) -> str:
        async with slots:
            return await ask(client, gateway, i)

    return [
        Counter(await asyncio.gather(*(one(i) for i in range(args.prompts))))
        for _ in range(args.rounds)
    ]


async def checked(client: httpx.AsyncClient, gateway: str) -> None:
    """Until the gateway has checked its backend (its canary's events believed)."""
    while True:
        backends = (await client.get(f"{gateway}/stats")).json()["backends"]
        if backends and backends[0]["routing_mode"] != "checking":
            return
        await asyncio.sleep(0.1)


async def indexed(client: httpx.AsyncClient, gateway: str, replica: Replica) -> None:
    """Until the gateway has every batch the replica published in its index."""
    while True:
        backends = (await client.get(f"{gateway}/stats")).json()["backends"]
        stream = backends[0]["kv_stream"] if backends else None
        published = replica.publisher.batches if replica.publisher else 0
        if stream and stream["indexed_through"] == published:
            return
        await asyncio.sleep(0.05)


def row(phase: str, each_round: list[Counter[str]]) -> str:
    outcomes = sum(each_round, Counter())
    total = sum(outcomes.values())
    share = outcomes["exact"] / total if total else 0.0
    return f"| {phase} | {total} | {share:.1%} | {outcomes['over']} | {outcomes['under']} |"


async def scenario(args: argparse.Namespace) -> None:
    app = create_app(ReplicaConfig(speedup=50.0, num_blocks=2048, host_blocks=0))
    replica: Replica = app.state.replica
    server, served = await serve_in_loop(app, "127.0.0.1", processes.free_port())
    url, port = f"http://127.0.0.1:{server.config.port}", processes.free_port()
    gateway_process = start_gateway(url, port, args.gateway_tree)
    gateway = f"http://127.0.0.1:{port}"
    try:
        await asyncio.to_thread(processes.wait_until, gateway, gateway_process)
        async with httpx.AsyncClient() as client:
            await checked(client, gateway)
            for i in range(args.prompts):
                await ask(client, gateway, i)  # cold: each prompt computed once
            await indexed(client, gateway, replica)
            before = await rounds(client, gateway, args)
            assert replica.engine.reset_cache() and replica.publisher is not None
            replica.publisher.withhold_for_tests()  # the engine evicts without telling
            after = await rounds(client, gateway, args)
            backend = (await client.get(f"{gateway}/stats")).json()["backends"][0]
    finally:
        processes.stop(gateway_process)
        server.stop()
        await served
    print("| phase | requests | exact | over | under |\n|---|---:|---:|---:|---:|")
    print(row("before the eviction", before))
    print(row("the first round after it", after[:1]))
    print(row("the rounds after that", after[1:]))
    stream = backend["kv_stream"]
    print(
        f"\nevent disagreements {backend.get('event_disagreements')}, decision corrections "
        f"{backend.get('decision_corrections')}; stream: {stream['batches']} batches, "
        f"{stream['replayed']} replayed, {stream['resyncs']} resyncs, {stream['gaps']} gaps"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--gateway-tree", default="", help="run the gateway from this checkout")
    asyncio.run(scenario(parser.parse_args()))


if __name__ == "__main__":
    main()
