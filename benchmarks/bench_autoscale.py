"""A fleet on a `ray start` cluster that grows under a burst and shrinks after it:
failed requests, and the hit rate while it shrinks, per scale-in rule.

    python -m benchmarks.bench_autoscale [--rules cache,random] [--seconds 20]

Starts its own `ray start --head` (2 CPUs, loopback) and, per rule, `prefix-router up
--replicas 2 --min-replicas 2 --max-replicas 4 --scale-in RULE` (simulated replicas at
0.2x speed, the autoscaler's delays short), then `down`. The load: ``--clients``
conversations at once, each on one of four system prompts, every turn resending its
history, for ``--seconds`` (the burst: the fleet grows to 4); then half of them go
on, and the others end, until the fleet is back to 2 and ``--tail-s`` more (the
evening: each stop moves the conversations it held). Prints, per rule, the requests,
the failures, the fleet's sizes, and the token hit rate of the turns sent from the first
replica draining on.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field

import httpx

from deploy.processes import free_port

SYSTEMS = [
    f"You are assistant {i} of the fleet. " + "Answer briefly and well. " * 60 for i in range(4)
]
LOOPBACK = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}


@dataclass
class Run:
    rule: str
    answers: list[tuple[float, int | str, int, int]] = field(
        default_factory=list
    )  # at, status, prompt, cached
    sizes: list[tuple[float, int, bool]] = field(default_factory=list)  # at, replicas, one draining

    def first_drain(self) -> float | None:
        return next((at for at, _, draining in self.sizes if draining), None)

    def hit_rate_since(self, start: float) -> float | None:
        late = [(p, c) for at, status, p, c in self.answers if at >= start and status == 200]
        prompt = sum(p for p, _ in late)
        return sum(c for _, c in late) / prompt if prompt else None


def command(*args: str) -> subprocess.CompletedProcess:
    argv = [sys.executable, "-m", "prefix_router", *args]
    done = subprocess.run(argv, capture_output=True, text=True, env=LOOPBACK, timeout=300)
    if done.returncode:
        raise RuntimeError(f"prefix-router {args[0]} failed: {done.stderr}")
    return done


async def conversation(
    client: httpx.AsyncClient, url: str, run: Run, index: int, until: list[float], started: float
) -> None:
    """One user's chat, turn after turn, until ``until[0]`` (moved by the driver)."""
    messages = [{"role": "system", "content": SYSTEMS[index % len(SYSTEMS)]}]
    turn = 0
    while time.monotonic() < until[0]:
        messages.append({"role": "user", "content": f"User {index}, turn {turn}: and then?"})
        body = {"messages": messages, "max_tokens": 40, "ignore_eos": True}
        at = time.monotonic() - started
        try:
            response = await client.post(f"{url}/v1/chat/completions", json=body)
            usage = response.json().get("usage", {}) if response.status_code == 200 else {}
            cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
            run.answers.append((at, response.status_code, usage.get("prompt_tokens", 0), cached))
            reply = response.json()["choices"][0]["message"]["content"] if usage else ""
        except httpx.HTTPError as error:
            run.answers.append((at, repr(error), 0, 0))
            reply = ""
        messages.append({"role": "assistant", "content": reply})
        turn += 1


async def drive(url: str, run: Run, args: argparse.Namespace) -> None:
    started = time.monotonic()
    async with httpx.AsyncClient(timeout=120) as client:
        stop = asyncio.Event()

        async def watch() -> None:
            while not stop.is_set():
                backends = (await client.get(f"{url}/stats")).json()["backends"]
                draining = any(b["draining"] for b in backends)
                run.sizes.append((time.monotonic() - started, len(backends), draining))
                await asyncio.sleep(0.5)

        watcher = asyncio.create_task(watch())
        burst, evening = [started + args.seconds], [started + 600.0]
        users = [
            asyncio.create_task(
                conversation(client, url, run, i, evening if i % 2 == 0 else burst, started)
            )
            for i in range(args.clients)
        ]
        while time.monotonic() < burst[0] or not run.sizes or run.sizes[-1][1] > 2:
            await asyncio.sleep(0.5)
            if time.monotonic() - started > 300:
                break
        evening[0] = time.monotonic() + args.tail_s
        await asyncio.gather(*users)
        stop.set()
        await watcher


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rules", default="cache,random")
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--tail-s", type=float, default=10.0)
    parser.add_argument("--clients", type=int, default=16)
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    ray = os.path.join(os.path.dirname(sys.executable), "ray")
    subprocess.run([ray, "get-auth-token", "--generate"], capture_output=True, env=LOOPBACK)
    start = [ray, "start", "--head", "--port", str(free_port()), "--num-cpus", "2"]
    quiet = ["--include-dashboard", "false", "--disable-usage-stats"]
    head = subprocess.run([*start, *quiet], capture_output=True, text=True, env=LOOPBACK)
    if head.returncode:
        raise SystemExit(f"ray start failed: {head.stderr}")
    fleet = shlex.split(
        "--replicas 2 --replica-speedup 0.2 --min-replicas 2 --max-replicas 4"
        " --target-ongoing-requests 5 --upscale-delay-s 1 --downscale-delay-s 4 --interval-s 0.5"
    )
    runs = []
    try:
        for rule in args.rules.split(","):
            port = free_port()
            command("up", "--address", "auto", "--port", str(port), *fleet, "--scale-in", rule)
            run = Run(rule)
            try:
                asyncio.run(drive(f"http://127.0.0.1:{port}", run, args))
            finally:
                command("down", "--address", "auto")
            runs.append(run)
    finally:
        subprocess.run([ray, "stop", "--force"], capture_output=True, env=LOOPBACK)
    print(
        "| scale-in | requests | failed | fleet sizes | hit rate, all | hit rate from the "
        "first drain |"
    )
    print("|---|---:|---:|---|---:|---:|")
    for run in runs:
        failed = sum(status != 200 for _, status, _, _ in run.answers)
        sizes = [n for _, n, _ in run.sizes]
        changes = [n for i, n in enumerate(sizes) if i == 0 or n != sizes[i - 1]]
        drain = run.first_drain()
        late = run.hit_rate_since(drain) if drain is not None else None
        whole = run.hit_rate_since(0.0)
        print(
            f"| {run.rule} | {len(run.answers)} | {failed} | {' -> '.join(map(str, changes))} "
            f"| {whole:.1%} | {'-' if late is None else f'{late:.1%}'} |"
        )


if __name__ == "__main__":
    main()
