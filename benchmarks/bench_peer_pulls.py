"""Peer pulls on the hot-prefix workload of issue 27, in the replayer: ``cache_aware``
with and without ``--peer-pulls``, and where the tail of time to first token is.

    python -m benchmarks.bench_peer_pulls [--sessions 600,3000] [--seeds 0,1,2]

8 replicas at 0.15 of an H100 (a pull at that speed too), 25 applications (Zipf
exponent 2: one 2,000-token system prompt in 60% of the requests), one turn each, 10 a
second. A pull can bring a system prompt only to a replica new to it: the first request
of each application computes its prompt wherever it lands (no peer holds it). So the
TTFT p99 is printed twice: over every request, and over the requests whose system
prompt some replica had already computed (each application's first request left out).
"""

from __future__ import annotations

import argparse
from dataclasses import replace

import numpy as np

from loadtest.replay import ReplayConfig, ReplayResult, replay
from loadtest.report import replay_row
from loadtest.workloads import ChatConfig, chat_workload
from router.policies import PolicyConfig

HOT = ChatConfig(
    num_apps=25,
    app_skew=2.0,
    system_prompt_tokens=2000,
    max_turns=1,
    session_rate=10.0,
)
FLEET = ReplayConfig(replicas=8, compute_scale=0.15)


def after_first(result: ReplayResult, apps: list[int]) -> list[float]:
    """TTFTs of the requests whose application had been asked for before."""
    seen, ttfts = set(), []
    for record in sorted(result.records, key=lambda r: r.arrival_s):
        app = apps[record.session]
        if app in seen and record.first_token_s is not None:
            ttfts.append(record.first_token_s - record.arrival_s)
        seen.add(app)
    return ttfts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", default="600,3000")
    parser.add_argument("--seeds", default="0,1,2")
    args = parser.parse_args()
    print("| requests | seed | peer pulls | hit rate | TTFT p99 | p99 after each app's first | "
          "imbalance | pulled | fallbacks |")  # fmt: skip
    print("|---:|---:|---|---:|---:|---:|---:|---:|---:|")
    for sessions in (int(s) for s in args.sessions.split(",")):
        for seed in (int(s) for s in args.seeds.split(",")):
            workload = chat_workload(replace(HOT, num_sessions=sessions, seed=seed))
            apps = [session.app for session in workload.sessions]
            for pulls in (False, True):
                config = replace(FLEET, seed=seed, routing=PolicyConfig.of(peer_pulls=pulls))
                result = replay(
                    chat_workload(replace(HOT, num_sessions=sessions, seed=seed)),
                    config,
                    "cache_aware",
                )
                row = replay_row(result)
                tail = np.percentile(after_first(result, apps), 99) * 1000
                print(
                    f"| {sessions} | {seed} | {'yes' if pulls else 'no'} | "
                    f"{row['token_hit_rate']:.1%} | {row['ttft_p99_s'] * 1000:.0f} ms | "
                    f"{tail:.0f} ms | {row['imbalance']:.2f} | {row['pulled_share']:.1%} | "
                    f"{row['pull_fallbacks']} |"
                )


if __name__ == "__main__":
    main()
