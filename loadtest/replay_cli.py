"""``prefix-router replay``: replay a workload offline and print its figures."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Sequence
from typing import Any

from tqdm import tqdm

from deploy.cli import add_config_flags, config_overrides
from loadtest.replay import ReplayConfig, replay
from loadtest.report import Row, command_line, format_table, replay_row, write_json
from loadtest.workloads import ChatConfig, Workload, load_workload

#: Capacities of ``--sweep-capacity`` without values: from far too small to ample.
DEFAULT_SWEEP = (128, 256, 512, 1024, 2048, 4096, 8192, 16384)

TABLE_KEYS = (
    "label", "replicas", "capacity_blocks", "requests", "block_hit_rate", "token_hit_rate",
    "prefill_tokens_computed", "prefill_tokens_saved", "evictions", "shared_prefix_evictions",
    "shared_prefix_hit_rate", "ttft_p50_s", "ttft_p99_s",
)  # fmt: skip


def add_replay_parser(commands: Any) -> None:
    parser: argparse.ArgumentParser = commands.add_parser(
        "replay",
        help="replay a workload through simulated replicas in virtual time",
        description=__doc__,
    )
    parser.add_argument("--workload", default="chat", help="chat or trace:PATH (default: chat)")
    parser.add_argument("--policies", default="round_robin", help="comma-separated policy names")
    parser.add_argument(
        "--sweep-capacity",
        nargs="?",
        const=",".join(map(str, DEFAULT_SWEEP)),
        metavar="BLOCKS,...",
        help=f"one row per capacity (default list: {','.join(map(str, DEFAULT_SWEEP))})",
    )
    parser.add_argument("--limit", type=int, help="replay only the first N trace requests")
    parser.add_argument(
        "--json", metavar="PATH", help="write the rows as JSON (DESIGN.md section 7)"
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_config_flags(parser, ReplayConfig)
    add_config_flags(parser, ChatConfig, prefix="chat-", skip=("seed",))
    parser.set_defaults(run=run_replay)


def _workload(args: argparse.Namespace) -> Workload:
    overrides = config_overrides(args, ChatConfig, prefix="chat_")
    if args.workload == "chat":
        overrides["seed"] = args.seed
    elif args.limit is not None:
        overrides = {"limit": args.limit}
    else:
        overrides = {}
    return load_workload(args.workload, overrides)


def _capacities(args: argparse.Namespace) -> list[int]:
    if not args.sweep_capacity:
        return [args.capacity_blocks]
    try:
        return [int(value) for value in args.sweep_capacity.split(",")]
    except ValueError:
        raise ValueError(
            f"--sweep-capacity takes whole numbers, got {args.sweep_capacity!r}"
        ) from None


def run_replay(args: argparse.Namespace) -> int:
    workload = _workload(args)
    base = ReplayConfig(**config_overrides(args, ReplayConfig))
    policies = [p for p in args.policies.split(",") if p]
    runs = [(policy, capacity) for capacity in _capacities(args) for policy in policies]
    rows = [
        _replay_one(workload, dataclasses.replace(base, capacity_blocks=c), p, args)
        for p, c in runs
    ]
    print(format_table(rows, TABLE_KEYS))
    if args.json:
        meta = {"seed": base.seed, "command": command_line(), "version": _version()}
        write_json(args.json, rows, meta)
        print(f"wrote {args.json}", file=sys.stderr)
    return 0


def _replay_one(
    workload: Workload, config: ReplayConfig, policy: str, args: argparse.Namespace
) -> Row:
    label = f"{policy} @ {config.capacity_blocks} blocks" if args.sweep_capacity else policy
    with tqdm(
        total=workload.num_requests,
        desc=label,
        unit="req",
        disable=args.no_progress,
        file=sys.stderr,
        leave=False,
    ) as bar:
        result = replay(workload, config, policy, on_request_done=lambda: bar.update())
    return replay_row(result, label)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("prefix-router")
    except PackageNotFoundError:
        return "unknown"


def main(argv: Sequence[str] | None = None) -> int:
    from deploy.cli import main as cli_main

    return cli_main(["replay", *(argv or [])])
