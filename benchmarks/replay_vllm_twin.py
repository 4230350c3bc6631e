"""The replay of `make demo-vllm`'s fleet at several calibrated profiles, offline.

``bench --engine vllm --replay-profile FILE`` prints one profile's replay beside each
live row; this prints several for one workload, to bracket a live run (docs/vllm.md):
two engines of the tiny model, their pools of 8,192 tokens (from the profile), vLLM's
CPU scheduler limits, the gateway's knobs of the demo (blocks of 32, stride 1), and the
bench's chat workload as the model's tokenizer and chat template read it.

    python -m benchmarks.replay_vllm_twin --sessions 150 --rate 2 \\
        benchmarks/data/tiny_vllm/alone.json benchmarks/data/tiny_vllm/beside_a_busy_process.json

``--reply-tokens``, ``--seed`` and ``--policies`` set the rest (the demo's answers are 16
tokens long now; its default is 60 as the profiles' runs had).
"""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path

from loadtest.bench.config import BenchConfig
from loadtest.bench.targets import VLLM_CPU_MAX_NUM_BATCHED_TOKENS, VLLM_CPU_MAX_NUM_SEQS
from loadtest.replay import ReplayConfig, replay
from loadtest.report import replay_row
from loadtest.workloads import retokenized
from replica.api.model_tokenizer import load_tokenizer
from router.policies import PolicyConfig

POLICIES = ("round_robin", "sglang_cache_aware", "cache_aware")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("profiles", nargs="+", metavar="PROFILE")
    parser.add_argument("--sessions", type=int, default=300)
    parser.add_argument("--rate", type=float, default=5.0, help="sessions per second")
    parser.add_argument("--model", default="reports/tiny-model")
    parser.add_argument("--reply-tokens", type=int, default=60)
    parser.add_argument("--seed", type=int, default=0, help="the workload's and the fleet's")
    parser.add_argument("--policies", default=",".join(POLICIES))
    args = parser.parse_args()
    chat = {"num_sessions": args.sessions, "session_rate": args.rate}
    chat["reply_tokens"] = args.reply_tokens
    tokenizer = load_tokenizer(str(Path(args.model).resolve()))
    workload = retokenized(BenchConfig(chat=chat, seed=args.seed).load(), tokenizer)
    defaults = PolicyConfig(block_size=32)
    routing = replace(defaults, index=replace(defaults.index, stride=1))
    for profile in args.profiles:
        print(f"{profile}:\n{'policy':<20}{'hit rate':>9}{'TTFT p50':>11}{'p99':>11}")
        twin = ReplayConfig(
            replicas=2,
            profile=profile,
            max_num_seqs=VLLM_CPU_MAX_NUM_SEQS,
            max_num_batched_tokens=VLLM_CPU_MAX_NUM_BATCHED_TOKENS,
            host_blocks=0,
            routing=routing,
            seed=args.seed,
        )
        for policy in args.policies.split(","):
            row = replay_row(replay(workload, twin, policy))
            p50, p99 = row["ttft_p50_s"] * 1e3, row["ttft_p99_s"] * 1e3
            print(f"{policy:<20}{row['token_hit_rate']:>9.1%}{p50:>9.0f}ms{p99:>9.0f}ms")


if __name__ == "__main__":
    main()
