"""Tenants sharing a saturated fleet, live: three steady tenants and a noisy one
through one gateway with API keys, under each of its queue's fairness modes.

    python -m benchmarks.bench_tenants [--seconds 40] [--fairness fcfs,vtc,prefill]

Four simulated replicas at 0.05x speed behind one gateway that admits
``--max-outstanding`` requests per replica and queues the rest (router/fairness.py).
Each steady tenant streams chats at 2 requests/s on its own 1,200-token system prompt
with a new question each time; the noisy tenant sends 20 requests/s on its own. The
first run has the steady tenants alone; then one run per fairness mode with the noisy
tenant too, each on fresh replicas (no cache carried over). Prints each tenant's TTFT
p50 and p99 (from sending to the first token, as the client sees it), its requests and
its refusals (429).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from tempfile import TemporaryDirectory

import httpx
import numpy as np

from deploy.processes import running

STEADY = {f"steady-{i}": 2.0 for i in range(1, 4)}
NOISY = {"noisy": 20.0}
WORDS = ("cache", "prefix", "route", "replica", "token", "block", "engine", "batch", "queue")


@dataclass
class Tenant:
    name: str
    rate: float
    system: str
    ttfts: list[float] = field(default_factory=list)
    refused: int = 0
    failed: int = 0


def system_prompt(name: str, tokens: int = 1200) -> str:
    """About ``tokens`` tokens of the simulated replicas' tokenizer (4 bytes each)."""
    rng = random.Random(name)
    text = f"You are {name}'s assistant. "
    while len(text) < 4 * tokens:
        text += rng.choice(WORDS) + " "
    return text[: 4 * tokens]


async def one(client: httpx.AsyncClient, url: str, tenant: Tenant, question: int) -> None:
    body = {
        "messages": [
            {"role": "system", "content": tenant.system},
            {
                "role": "user",
                "content": f"Question {question}: what is a {WORDS[question % len(WORDS)]}?",
            },
        ],
        "max_tokens": 32,
        "ignore_eos": True,
        "stream": True,
    }
    headers = {"authorization": f"Bearer key-{tenant.name}"}
    sent = time.monotonic()
    try:
        async with client.stream(
            "POST", f"{url}/v1/chat/completions", json=body, headers=headers
        ) as response:
            if response.status_code == 429:
                tenant.refused += 1
                return
            if response.status_code != 200:
                tenant.failed += 1
                return
            first = True
            async for line in response.aiter_lines():  # read to the end: the slot frees then
                if first and line.startswith("data: {") and '"content"' in line:
                    tenant.ttfts.append(time.monotonic() - sent)
                    first = False
    except httpx.HTTPError:
        tenant.failed += 1


async def offer(url: str, tenants: list[Tenant], seconds: float) -> None:
    """Open loop: each tenant's requests at its rate (Poisson), whatever the answers."""
    limits = httpx.Limits(max_connections=2000, max_keepalive_connections=2000)
    async with httpx.AsyncClient(timeout=300, limits=limits) as client:
        tasks: list[asyncio.Task[None]] = []

        async def arrivals(tenant: Tenant) -> None:
            rng, question, end = random.Random(tenant.name), 0, time.monotonic() + seconds
            while time.monotonic() < end:
                tasks.append(asyncio.create_task(one(client, url, tenant, question)))
                question += 1
                await asyncio.sleep(rng.expovariate(tenant.rate))

        await asyncio.gather(*(arrivals(t) for t in tenants))
        await asyncio.gather(*tasks)


def run(fairness: str, rates: dict[str, float], args: argparse.Namespace) -> list[Tenant]:
    tenants = [Tenant(name, rate, system_prompt(name)) for name, rate in rates.items()]
    replica = ["replica", "--speedup", str(args.speedup)]
    with TemporaryDirectory() as tmp:
        keys = Path(tmp) / "keys.txt"
        keys.write_text("".join(f"key-{t.name} {t.name}\n" for t in tenants))
        with running(*[replica] * args.replicas) as replicas:
            gateway = [
                "gateway", *[f"--backend={u}" for u in replicas], "--api-keys-file", str(keys),
                "--max-outstanding-per-replica", str(args.max_outstanding),
                "--fairness", fairness, "--max-queued", "100000", "--queue-timeout-s", "300",
            ]  # fmt: skip
            with running(gateway) as (url,):
                asyncio.run(offer(url, tenants, args.seconds))
    return tenants


def report(label: str, tenants: list[Tenant]) -> None:
    for t in tenants:
        p50, p99 = (float(np.percentile(t.ttfts, q)) if t.ttfts else float("nan") for q in (50, 99))
        print(
            f"| {label} | {t.name} | {len(t.ttfts)} | {1000 * p50:.0f} ms | {1000 * p99:.0f} ms "
            f"| {t.refused} | {t.failed} |",
            flush=True,
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=40.0)
    parser.add_argument("--fairness", default="fcfs,vtc,prefill")
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--speedup", type=float, default=0.05)
    parser.add_argument("--max-outstanding", type=int, default=4)
    args = parser.parse_args()
    # killed (by ``timeout``, say): unwind, so ``running`` stops the servers it started
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    print("| run | tenant | answered | TTFT p50 | TTFT p99 | refused (429) | failed |")
    print("|---|---|---:|---:|---:|---:|---:|")
    report("steady alone", run("prefill", STEADY, args))
    for fairness in args.fairness.split(","):
        report(f"with noisy, {fairness}", run(fairness, {**STEADY, **NOISY}, args))


if __name__ == "__main__":
    main()
