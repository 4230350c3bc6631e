"""Routing in predicted seconds (``cache_aware_ttft``) against token weights and the
baselines, in the replayer, where the tail of time to first token comes from.

    python -m benchmarks.bench_ttft_routing [--jobs 2]

Two fleets: the chat workload on 4 replicas of 4,096 blocks, at engine speeds where
queues form (0.6 of an H100), where they grow (0.45) and the issue's held-out load
(0.35); and the Mooncake trace on 8 replicas of 26,000 blocks (GPU only). For each
policy: the token hit rate, TTFT p50 and p99, and the TTFT floor, the p99 of each
request's own prefill alone on an idle engine with the hits it found (no placement
at that hit rate can bring the p99 far below it); and the slowest 1% of requests,
split into that own prefill and the rest, the wait (queued prefill ahead, KV blocks
to come free, other prompts computed in the same step).
"""

from __future__ import annotations

import argparse
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tqdm import tqdm

from loadtest.replay import ReplayConfig, replay
from loadtest.workloads import ChatConfig, Workload, WorkloadOptions, workload_for
from replica.api.cost_model import get_profile

POLICIES = ("round_robin", "sglang_cache_aware", "cache_aware", "cache_aware_ttft")
CHAT_SPEEDS = (0.6, 0.45, 0.35)
TRACE = Path(__file__).parents[2] / "shared" / "traces" / "mooncake_conversation.jsonl"


@dataclass(frozen=True)
class Fleet:
    label: str
    config: ReplayConfig
    workload: str  # its spec: "chat" (its load per replica) or "trace:PATH"


@dataclass(frozen=True)
class Row:
    fleet: str
    policy: str
    hit_rate: float
    ttft_p50_s: float
    ttft_p99_s: float
    floor_p99_s: float
    slowest_ttft_s: float
    slowest_own_s: float

    @property
    def slowest_wait_s(self) -> float:
        return self.slowest_ttft_s - self.slowest_own_s


def fleets(trace: Path) -> list[Fleet]:
    chat = []
    for speed in CHAT_SPEEDS:
        config = ReplayConfig(replicas=4, capacity_blocks=4096, host_blocks=0, compute_scale=speed)
        chat.append(Fleet(f"chat, 4 replicas at {speed}x", config, "chat"))
    mooncake = ReplayConfig(replicas=8, capacity_blocks=26000, host_blocks=0)
    if not trace.is_file():
        return chat
    return [*chat, Fleet("Mooncake, 8 replicas", mooncake, f"trace:{trace}")]


def workload_of(fleet: Fleet) -> Workload:
    """The fleet's workload, its load per replica as ``prefix-router replay`` sets it."""
    base = ChatConfig()
    options = WorkloadOptions(
        replicas=fleet.config.replicas,
        sessions_per_replica=base.num_sessions,
        rate_per_replica=base.session_rate,
    )
    return workload_for(fleet.workload, options)


def measure(fleet: Fleet, policy: str) -> Row:
    result = replay(workload_of(fleet), fleet.config, policy)
    profile, scale = get_profile(fleet.config.profile), fleet.config.compute_scale
    done = [r for r in result.records if r.first_token_s is not None]
    ttft = np.array([r.first_token_s - r.arrival_s for r in done])
    own = np.array(
        [profile.prefill_time(r.cached_tokens, r.prompt_tokens - r.cached_tokens) for r in done]
    )
    own = own / scale
    slowest = np.argsort(ttft)[-max(1, len(ttft) // 100) :]
    cached = sum(r.cached_tokens for r in done)
    prompts = sum(r.prompt_tokens for r in done)
    return Row(
        fleet.label,
        policy,
        hit_rate=cached / prompts,
        ttft_p50_s=float(np.percentile(ttft, 50)),
        ttft_p99_s=float(np.percentile(ttft, 99)),
        floor_p99_s=float(np.percentile(own, 99)),
        slowest_ttft_s=float(ttft[slowest].mean()),
        slowest_own_s=float(own[slowest].mean()),
    )


def seconds(value: float) -> str:
    return f"{value * 1e3:.0f} ms" if value < 1 else f"{value:.2f} s"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=2, help="replays at once (default: 2)")
    parser.add_argument("--trace", type=Path, default=TRACE, help="the Mooncake trace")
    args = parser.parse_args()
    cases = [(fleet, policy) for fleet in fleets(args.trace) for policy in POLICIES]
    with ProcessPoolExecutor(args.jobs) as pool:
        replays = pool.map(measure, *zip(*cases, strict=True))
        rows = list(tqdm(replays, total=len(cases), desc="replays", unit="replay"))
    print(
        "| fleet | policy | token hit rate | TTFT p50 | TTFT p99 | own-prefill p99 (floor) "
        "| slowest 1%: TTFT = own prefill + wait |"
    )
    print("|---|---|---:|---:|---:|---:|---|")
    for row in rows:
        print(table_line(row))


def table_line(row: Row) -> str:
    own, wait = seconds(row.slowest_own_s), seconds(row.slowest_wait_s)
    cells = [
        row.fleet,
        row.policy,
        f"{row.hit_rate:.1%}",
        seconds(row.ttft_p50_s),
        seconds(row.ttft_p99_s),
        seconds(row.floor_p99_s),
        f"{seconds(row.slowest_ttft_s)} = {own} + {wait}",
    ]
    return "| " + " | ".join(cells) + " |"


if __name__ == "__main__":
    main()
