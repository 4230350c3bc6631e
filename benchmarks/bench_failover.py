"""A gateway killed mid-load: what the clients see, and how soon its successor routes
as well as its peers.

    python -m benchmarks.bench_failover [--gateways 4] [--rate 20] [--seconds 60]

``prefix-router serve --gateways N`` on one shared port (SO_REUSEPORT: the kernel
spreads new connections over the gateway processes), in front of simulated replicas.
Clients hold chat conversations (each turn sends the whole history and a new
question), open loop at ``--rate`` requests/s, a new connection per request so that
every request lands on whichever gateway the kernel picks. At ``--kill-at`` seconds
one gateway process is killed with SIGKILL; Ray restarts its actor and the new
process learns the cache from the replicas' replay buffers.

Prints the requests that failed against those the killed process held (its
established connections the moment it died), the seconds until its successor
answered, and each gateway's prediction accuracy (a prediction is close when the
replica's reported cached tokens are within a block of the router's) in windows after
the restart: the successor's beside its peers'.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from deploy import processes

WORDS = ("cache", "prefix", "route", "replica", "token", "block", "engine", "batch", "queue")
#: A new connection for every request: the kernel picks a gateway per connection.
NO_KEEPALIVE = httpx.Limits(max_keepalive_connections=0)
#: Socket states in ``/proc/net/tcp``.
TCP_ESTABLISHED, TCP_LISTEN = "01", "0A"


@dataclass
class Sample:
    """One gateway's cumulative prediction counts, as one ``/stats`` answer said them."""

    at: float
    predictions: int
    close: int


@dataclass
class Gateways:
    """Every gateway process behind the port, told apart by the pid in its ``/stats``."""

    url: str
    replicas: int
    samples: dict[int, list[Sample]] = field(default_factory=dict)
    first_seen: dict[int, float] = field(default_factory=dict)

    def record(self, stats: dict, at: float) -> None:
        if len(stats["backends"]) < self.replicas:
            return  # still finding the replicas: not routing as its peers do yet
        counts = [c for b in stats["backends"] for c in b["by_policy"].values()]
        sample = Sample(
            at, sum(c["predictions"] for c in counts), sum(c["close_predictions"] for c in counts)
        )
        self.first_seen.setdefault(stats["pid"], at)
        self.samples.setdefault(stats["pid"], []).append(sample)

    def accuracy(self, pids: list[int], start: float, end: float) -> tuple[float | None, int]:
        """Close predictions over predictions the gateways ``pids`` made in
        ``[start, end)``, and how many they made."""
        made = close = 0
        for pid in pids:
            inside = [s for s in self.samples.get(pid, []) if start <= s.at < end]
            before = [s for s in self.samples.get(pid, []) if s.at < start]
            if inside:
                base = before[-1] if before else Sample(start, 0, 0)
                made += inside[-1].predictions - base.predictions
                close += inside[-1].close - base.close
        return (close / made if made else None), made

    def peers(self, *apart: int | None) -> list[int]:
        return [pid for pid in self.samples if pid not in apart]


async def watch(gateways: Gateways, until: asyncio.Event, interval_s: float = 0.05) -> None:
    """Ask ``/stats`` over new connections, several at once, so that every gateway
    behind the port is sampled a few times a second."""

    async def one(client: httpx.AsyncClient) -> None:
        with_answer = await client.get(f"{gateways.url}/stats")
        gateways.record(with_answer.json(), time.monotonic())

    async with httpx.AsyncClient(timeout=5, limits=NO_KEEPALIVE) as client:
        while not until.is_set():
            # A poll that reached the killed gateway fails, as any request does.
            await asyncio.gather(*(one(client) for _ in range(4)), return_exceptions=True)
            await asyncio.sleep(interval_s)


@dataclass
class Outcomes:
    ok: int = 0
    failed: list[str] = field(default_factory=list)
    #: Sending times of the failed requests (seconds since the load began).
    failed_at: list[float] = field(default_factory=list)


async def converse(
    url: str, rate: float, seconds: float, conversations: int, seed: int = 0
) -> Outcomes:
    """Open loop: a turn of a random conversation every ``1/rate`` s on average."""
    rng = random.Random(seed)
    words = " ".join(rng.choice(WORDS) for _ in range(600))
    systems = [f"Assistant {i}. {words}" for i in range(4)]  # four applications
    histories = [[{"role": "system", "content": systems[i % 4]}] for i in range(conversations)]
    outcomes, began = Outcomes(), time.monotonic()

    async def turn(client: httpx.AsyncClient, history: list[dict], sent: float) -> None:
        question = {"role": "user", "content": " ".join(rng.choice(WORDS) for _ in range(30))}
        body = {"messages": [*history, question], "max_tokens": 16, "ignore_eos": True}
        try:
            answer = await client.post(f"{url}/v1/chat/completions", json=body)
            answer.raise_for_status()
        except httpx.HTTPError as error:
            outcomes.failed.append(type(error).__name__)
            outcomes.failed_at.append(sent - began)
            return
        reply = answer.json()["choices"][0]["message"]["content"]
        history.extend((question, {"role": "assistant", "content": reply}))
        outcomes.ok += 1

    async with httpx.AsyncClient(timeout=60, limits=NO_KEEPALIVE) as client:
        tasks = []
        while time.monotonic() - began < seconds:
            history = rng.choice(histories)
            tasks.append(asyncio.create_task(turn(client, history, time.monotonic())))
            await asyncio.sleep(rng.expovariate(rate))
        await asyncio.gather(*tasks)
    return outcomes


def held_connections(pid: int, port: int) -> int:
    """The connections to ``port`` that die with process ``pid``: those it accepted
    and those waiting in its listening socket's accept queue (the kernel gave them to
    it, it had not taken them yet). With a new connection per request, the requests
    it holds (and any ``/stats`` poll), as Linux's ``/proc/net/tcp`` lists them."""
    owned = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(OSError):
            target = os.readlink(fd)
            if target.startswith("socket:["):
                owned.add(target[len("socket:[") : -1])
    held = 0
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        local_port, state, inode = int(fields[1].split(":")[1], 16), fields[3], fields[9]
        if inode not in owned or local_port != port:
            continue
        if state == TCP_ESTABLISHED:
            held += 1
        elif state == TCP_LISTEN:  # its receive queue is the accept queue's length
            held += int(fields[4].split(":")[1], 16)
    return held


@dataclass
class Failover:
    outcomes: Outcomes
    gateways: Gateways
    victim: int
    held: int
    killed_at: float
    successor: int | None
    back_after_s: float | None


async def kill_one_mid_load(
    url: str, port: int, gateways: Gateways, args: argparse.Namespace
) -> Failover:
    stop = asyncio.Event()
    watcher = asyncio.create_task(watch(gateways, stop))
    load = asyncio.create_task(converse(url, args.rate, args.seconds, args.conversations))
    await asyncio.sleep(args.kill_at)
    before = set(gateways.samples)
    victim = sorted(before)[0]
    os.kill(victim, signal.SIGSTOP)  # frozen, it takes nothing more while it is counted
    held = held_connections(victim, port)
    os.kill(victim, signal.SIGKILL)
    killed_at = time.monotonic()
    outcomes = await load
    stop.set()
    await watcher
    successors = [p for p in gateways.samples if p not in before]
    successor = successors[0] if successors else None
    back = gateways.first_seen[successor] - killed_at if successor else None
    return Failover(outcomes, gateways, victim, held, killed_at, successor, back)


@contextmanager
def serving(args: argparse.Namespace) -> Iterator[tuple[str, int]]:
    """``serve`` on one shared port; its URL and port once every gateway routes."""
    port = processes.free_port()
    fleet = ["--replicas", str(args.replicas), "--gateways", str(args.gateways)]
    command = ["serve", *fleet, "--replica-speedup", str(args.speedup)]
    process = processes.start(command, port)
    url = f"http://127.0.0.1:{port}"
    try:
        seen = Gateways(url, args.replicas)
        deadline = time.monotonic() + 300
        while len(seen.samples) < args.gateways:
            assert time.monotonic() < deadline, "the gateways did not all start"
            processes.wait_until(url, process, path="/stats", timeout_s=300)
            with httpx.Client(timeout=5, limits=NO_KEEPALIVE) as client:
                seen.record(client.get(f"{url}/stats").json(), time.monotonic())
        yield url, port
    finally:
        processes.stop(process)


def report(run: Failover, windows_s: list[float]) -> None:
    outcomes, gateways = run.outcomes, run.gateways
    total = outcomes.ok + len(outcomes.failed)
    kinds = ", ".join(sorted(set(outcomes.failed))) or "none"
    print(
        f"requests: {total}, failed: {len(outcomes.failed)} ({kinds}); the killed gateway "
        f"held {run.held} connections"
    )
    if run.successor is None or run.back_after_s is None:
        print("its successor never answered")
        return
    print(f"successor (pid {run.successor}) answered {run.back_after_s:.2f} s after the kill")
    start = gateways.first_seen[run.successor]
    peers = gateways.peers(run.victim, run.successor)
    print("| after its restart | its prediction accuracy (predictions) | its peers' |")
    print("|---|---|---|")
    for begin, end in zip([0.0, *windows_s], windows_s, strict=False):
        mine, made = gateways.accuracy([run.successor], start + begin, start + end)
        theirs, peer_made = gateways.accuracy(peers, start + begin, start + end)
        print(
            f"| {begin:.0f}-{end:.0f} s | {percent(mine)} ({made}) | "
            f"{percent(theirs)} ({peer_made}) |"
        )


def percent(value: float | None) -> str:
    return "n/a" if value is None else f"{100 * value:.1f}%"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gateways", type=int, default=4)
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--speedup", type=float, default=1.0, help="the replicas' speed-up")
    parser.add_argument("--rate", type=float, default=20.0, help="requests/s")
    parser.add_argument("--conversations", type=int, default=80)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--kill-at", type=float, default=15.0, help="seconds into the load")
    args = parser.parse_args(argv)
    with serving(args) as (url, port):
        run = asyncio.run(kill_one_mid_load(url, port, Gateways(url, args.replicas), args))
    report(run, [5.0, 10.0, 20.0, 30.0])


if __name__ == "__main__":
    main()
