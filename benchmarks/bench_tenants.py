"""Tenants sharing a saturated fleet, live and in its replay twin: three steady tenants
and a noisy one through one gateway with API keys, under each of its queue's fairness
modes.

    python -m benchmarks.bench_tenants [--seconds 40] [--fairness fcfs,vtc,prefill]

Four simulated replicas at 0.05x speed (each engine running ``--max-num-seqs`` at once)
behind one gateway that admits ``--max-outstanding`` requests per replica, and a tenant
beyond its share while an engine keeps fewer than ``--max-engine-waiting`` waiting, and
queues the rest (router/fair/fairness.py, router/fair/slots.py). Each steady tenant
streams chats at 2 requests/s on its own 1,200-token system prompt with a new question
each time; the noisy tenant sends 20 requests/s on its own. The first run has the steady
tenants alone; then one run per fairness mode with the noisy tenant too, each on fresh
replicas (no cache carried over). The requests are drawn once, as a workload (the same
arrival times, prompts and lengths in every run), and each run is replayed on the
fleet's simulated twin (``loadtest/replay/``: the same engines, policy and admission in
virtual time). Prints each tenant's TTFT p50 and p99, live (from sending to the first
streamed token, as the client sees it) beside the twin's, and its refusals (429) and
failures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from tempfile import TemporaryDirectory

import httpx
import numpy as np

from deploy.processes import running
from loadtest.replay import ReplayConfig, replay
from loadtest.report import replay_row
from loadtest.workloads import Session, Turn, Workload
from replica.api.tokenizer import ByteTokenizer, Message

STEADY = {f"steady-{i}": 2.0 for i in range(1, 4)}
NOISY = {"noisy": 20.0}
WORDS = ("cache", "prefix", "route", "replica", "token", "block", "engine", "batch", "queue")
REPLY_TOKENS = 32


@dataclass
class Outcome:
    """One tenant's requests in one run."""

    ttfts: list[float] = field(default_factory=list)
    refused: int = 0
    failed: int = 0


def system_prompt(name: str, tokens: int = 1200) -> str:
    """About ``tokens`` tokens of the simulated replicas' tokenizer (4 bytes each)."""
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    text = f"You are {name}'s assistant. "
    while len(text) < 4 * tokens:
        text += WORDS[int(rng.integers(len(WORDS)))] + " "
    return text[: 4 * tokens]


def tenant_workload(rates: dict[str, float], seconds: float, seed: int = 0) -> Workload:
    """Each tenant's requests at its rate (Poisson) for ``seconds``: one turn each, its
    system prompt and a new question, as the live client sends them and the twin
    replays them."""
    tokenizer = ByteTokenizer()
    sessions = []
    for name, rate in rates.items():
        rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
        system = system_prompt(name)
        at, question = float(rng.exponential(1 / rate)), 0
        while at < seconds:
            messages: tuple[Message, ...] = (
                {"role": "system", "content": system},
                {
                    "role": "user",
                    "content": f"Question {question}: what is a {WORDS[question % len(WORDS)]}?",
                },
            )
            prompt = tokenizer.apply_chat_template(messages)
            turn = Turn(lambda prompt=prompt: prompt, REPLY_TOKENS, messages=messages)
            sessions.append(
                Session(f"{name}/{question}", at, (turn,), cache_salt=name, tenant=name)
            )
            at, question = at + float(rng.exponential(1 / rate)), question + 1
    sessions.sort(key=lambda s: s.start_time_s)
    return Workload("tenants", tuple(sessions))


async def one(client: httpx.AsyncClient, url: str, session: Session, outcome: Outcome) -> None:
    turn = session.turns[0]
    body = {
        "messages": list(turn.messages or ()),
        "max_tokens": turn.max_tokens,
        "ignore_eos": True,
        "stream": True,
    }
    headers = {"authorization": f"Bearer key-{session.tenant}"}
    sent = time.monotonic()
    try:
        async with client.stream(
            "POST", f"{url}/v1/chat/completions", json=body, headers=headers
        ) as response:
            if response.status_code == 429:
                outcome.refused += 1
                return
            if response.status_code != 200:
                outcome.failed += 1
                return
            first = True
            async for line in response.aiter_lines():  # read to the end: the slot frees then
                if first and line.startswith("data: {") and has_text(line):
                    outcome.ttfts.append(time.monotonic() - sent)
                    first = False
    except httpx.HTTPError:
        outcome.failed += 1


def has_text(line: str) -> bool:
    """Whether an SSE chunk carries generated text: the first chunk of a stream carries
    the role and empty content before any token is computed, as vLLM's does."""
    choices = json.loads(line.removeprefix("data: ")).get("choices") or [{}]
    return bool(choices[0].get("delta", {}).get("content"))


async def offer(url: str, workload: Workload, outcomes: dict[str, Outcome]) -> None:
    """Open loop: every request at its time in the workload, whatever the answers."""
    limits = httpx.Limits(max_connections=2000, max_keepalive_connections=2000)
    async with httpx.AsyncClient(timeout=300, limits=limits) as client:
        tasks: list[asyncio.Task[None]] = []
        start = time.monotonic()
        for session in workload.sessions:
            await asyncio.sleep(max(0.0, start + session.start_time_s - time.monotonic()))
            outcome = outcomes[session.tenant or ""]
            tasks.append(asyncio.create_task(one(client, url, session, outcome)))
        await asyncio.gather(*tasks)


def live(
    workload: Workload, fairness: str, args: argparse.Namespace
) -> tuple[dict[str, Outcome], float]:
    """Each tenant's outcome, and the fleet's token hit rate (the gateway's figure)."""
    outcomes = {name: Outcome() for name in tenants_of(workload)}
    replica = ["replica", "--speedup", str(args.speedup), "--max-num-seqs", str(args.max_num_seqs)]
    with TemporaryDirectory() as tmp:
        keys = Path(tmp) / "keys.txt"
        keys.write_text("".join(f"key-{name} {name}\n" for name in outcomes))
        with running(*[replica] * args.replicas) as replicas:
            backends = [f"--backend={u}" for u in replicas]
            slots = ["--max-outstanding-per-replica", str(args.max_outstanding)]
            slots += ["--fair-reserve-per-replica", str(args.reserve), "--fairness", fairness]
            slots += ["--max-engine-waiting", str(args.max_engine_waiting)]
            queue = ["--max-queued", "100000", "--queue-timeout-s", "300"]
            gateway = ["gateway", *backends, "--api-keys-file", str(keys), *slots, *queue]
            with running(gateway) as (url,):
                asyncio.run(offer(url, workload, outcomes))
                totals = httpx.get(f"{url}/stats").json()["totals"]
    return outcomes, totals["token_hit_rate"] or 0.0


def twin(
    workload: Workload, fairness: str, args: argparse.Namespace
) -> tuple[dict[str, Outcome], float]:
    """The same requests on simulated replicas in virtual time (as ``replay``): each
    tenant's outcome, and the fleet's token hit rate."""
    config = ReplayConfig(
        replicas=args.replicas,
        compute_scale=args.speedup,
        max_outstanding=args.max_outstanding,
        fair_reserve_per_replica=args.reserve,
        max_engine_waiting=args.max_engine_waiting,
        max_num_seqs=args.max_num_seqs,
        fairness=fairness,
    )
    outcomes = {name: Outcome() for name in tenants_of(workload)}
    result = replay(workload, config, "cache_aware")
    for record in result.records:
        outcome = outcomes[record.tenant or ""]
        if record.first_token_s is None:
            outcome.failed += 1
        else:
            outcome.ttfts.append(record.first_token_s - record.arrival_s)
    return outcomes, replay_row(result)["token_hit_rate"]


def tenants_of(workload: Workload) -> list[str]:
    return list(dict.fromkeys(s.tenant or "" for s in workload.sessions))


def percentiles(values: list[float]) -> tuple[float, float]:
    if not values:
        return float("nan"), float("nan")
    return float(np.percentile(values, 50)), float(np.percentile(values, 99))


def report(
    label: str, seen: tuple[dict[str, Outcome], float], replayed: tuple[dict[str, Outcome], float]
) -> None:
    (outcomes, hit_rate), (twin_outcomes, twin_hit_rate) = seen, replayed
    print(
        f"| {label} | (fleet) | token hit rate {100 * hit_rate:.1f}% "
        f"| | | twin {100 * twin_hit_rate:.1f}% | | | |",
        flush=True,
    )
    for name, outcome in outcomes.items():
        p50, p99 = percentiles(outcome.ttfts)
        twin50, twin99 = percentiles(twin_outcomes[name].ttfts)
        print(
            f"| {label} | {name} | {len(outcome.ttfts)} | {1000 * p50:.0f} ms | "
            f"{1000 * p99:.0f} ms | {1000 * twin50:.0f} ms | {1000 * twin99:.0f} ms "
            f"| {outcome.refused} | {outcome.failed} |",
            flush=True,
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=40.0)
    parser.add_argument("--fairness", default="fcfs,vtc,prefill")
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--speedup", type=float, default=0.05)
    parser.add_argument("--max-outstanding", type=int, default=16)
    parser.add_argument("--reserve", type=int, default=2, help="--fair-reserve-per-replica")
    parser.add_argument("--max-engine-waiting", type=int, default=4)
    parser.add_argument("--max-num-seqs", type=int, default=256, help="each replica's engine")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--twin-only", action="store_true", help="replay only, no live run")
    args = parser.parse_args()
    # killed (by ``timeout``, say): unwind, so ``running`` stops the servers it started
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    print(
        "| run | tenant | answered | TTFT p50 | TTFT p99 | twin p50 | twin p99 "
        "| refused (429) | failed |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    runs = [("steady alone", "prefill", STEADY)]
    runs += [(f"with noisy, {f}", f, {**STEADY, **NOISY}) for f in args.fairness.split(",")]
    for label, fairness, rates in runs:
        workload = tenant_workload(rates, args.seconds, args.seed)
        replayed = twin(workload, fairness, args)
        report(label, replayed if args.twin_only else live(workload, fairness, args), replayed)


if __name__ == "__main__":
    main()
