"""Routing at saturation, in the replayer: the ``shared_prefix`` workload at offered
loads from half the fleet's capacity to twice it, per policy.

    python -m benchmarks.saturation_sweep [--loads 0.5,1,1.5,2] [--seeds 0,1,2]
        [--policies round_robin,sglang_cache_aware,cache_aware,cache_aware_ttft]
        [--out DIR]

8 replicas of 4,096 blocks (Llama-3-8B on a fifth of an H100: the fleet serves about
9 requests a second, as in the capacity planner's trial of issue 41); 96 groups of
requests sharing a 4,096-token system prompt (three quarters of the fleet's KV cache
together), each a 32-token question and a 400-token answer, at a flat rate (3,000
requests). The fleet's capacity is measured first: the requests a second SGLang's
policy (unchanged by this project's work, so every run measures the same) serves when
offered three times a guess. Each row is the median of the seeds: the token hit rate,
the requests served a second (finished by the last arrival, over that time: the service
rate once the fleet is saturated, the offered rate below it) and TTFT p50/p90/p99.
``--out`` draws hit rate and TTFT p90 against the offered load (``saturation.png``)
and writes the rows as JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

from loadtest import plots
from loadtest.replay import ReplayConfig, ReplayResult, replay
from loadtest.report import replay_row
from loadtest.workloads import SHARED_PREFIX, ChatConfig, chat_workload
from router.policies import PolicyConfig

FLEET = ReplayConfig(replicas=8, capacity_blocks=4096, host_blocks=0, compute_scale=0.2)
POLICIES = "round_robin,sglang_cache_aware,cache_aware,cache_aware_ttft"
#: The guess the capacity is measured from, offered three times over (requests a second).
GUESS_RPS = 8.0


def workload(rate: float, sessions: int, seed: int) -> ChatConfig:
    """The shared-prefix workload at a flat ``rate`` (one request per session)."""
    shape = {**SHARED_PREFIX, "rate_shape": "flat", "num_sessions": sessions}
    return replace(ChatConfig(**shape), session_rate=rate, seed=seed)


def served_rps(result: ReplayResult) -> float:
    """Requests finished by the last arrival, a second of that time."""
    end = max(r.arrival_s for r in result.records)
    return sum(1 for r in result.records if r.finish_s is not None and r.finish_s <= end) / end


def run(job: tuple[str, float, int, int, dict[str, float]]) -> dict[str, Any]:
    """One replay: ``(policy, rate, sessions, seed, routing knobs)``."""
    policy, rate, sessions, seed, knobs = job
    fleet = replace(FLEET, seed=seed, routing=PolicyConfig.of(**knobs))
    result = replay(chat_workload(workload(rate, sessions, seed)), fleet, policy)
    row = replay_row(result)
    keys = ("token_hit_rate", "ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "imbalance")
    return {"policy": policy, "seed": seed, "served_rps": served_rps(result)} | {
        k: row[k] for k in keys
    }


def medians(runs: list[dict[str, Any]]) -> dict[str, float]:
    keys = ("served_rps", "token_hit_rate", "ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "imbalance")
    return {k: statistics.median(r[k] for r in runs) for k in keys}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--loads", default="0.5,0.75,1,1.25,1.5,2")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--policies", default=POLICIES)
    parser.add_argument("--sessions", type=int, default=3000)
    parser.add_argument(
        "--saturation-weight", type=float, help="the policies' (default: their own)"
    )
    parser.add_argument("--capacity-rps", type=float, help="skip measuring it")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    knobs = {} if args.saturation_weight is None else {"saturation_weight": args.saturation_weight}
    policies = args.policies.split(",")
    with ProcessPoolExecutor(args.jobs) as pool:
        capacity = args.capacity_rps
        if capacity is None:
            probes = [("sglang_cache_aware", 3 * GUESS_RPS, args.sessions, s, {}) for s in seeds]
            capacity = statistics.median(r["served_rps"] for r in pool.map(run, probes))
        print(f"capacity: {capacity:.2f} requests/s (SGLang's policy, offered {3 * GUESS_RPS:g})")
        loads = [float(x) for x in args.loads.split(",")]
        jobs = [
            (p, f * capacity, args.sessions, s, knobs)
            for f in loads
            for p in policies
            for s in seeds
        ]
        done = list(pool.map(run, jobs))
    rows = []
    print(
        "| load | policy | served req/s | hit rate | TTFT p50 | TTFT p90 | TTFT p99 | imbalance |"
    )
    print("|---:|---|---:|---:|---:|---:|---:|---:|")
    for load in loads:
        for policy in policies:
            runs = [
                d
                for d, j in zip(done, jobs, strict=True)
                if j[0] == policy and j[1] == load * capacity
            ]
            row = {"load": load, "policy": policy, **medians(runs)}
            rows.append(row)
            print(
                f"| {load:g}x | {policy} | {row['served_rps']:.2f} | {row['token_hit_rate']:.1%} | "
                f"{row['ttft_p50_s']:.2f} s | {row['ttft_p90_s']:.2f} s | "
                f"{row['ttft_p99_s']:.2f} s | {row['imbalance']:.2f} |"
            )
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "saturation.json").write_text(
            json.dumps({"capacity_rps": capacity, "rows": rows, "runs": done}, indent=2) + "\n"
        )
        plots.saturation_chart(rows, args.out / "saturation.png")
        print(f"wrote {args.out / 'saturation.png'}")


if __name__ == "__main__":
    main()
