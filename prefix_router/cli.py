"""``prefix-router``: one parser over the commands each package registers."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from deploy.commands import add_deploy_commands
from deploy.replicas import ReplicaStartError
from loadtest.bench_cli import add_bench_parser
from loadtest.calibrate import add_calibrate_parser
from loadtest.crossover import add_crossover_parser
from loadtest.replay_cli import add_replay_parser

DESCRIPTION = (
    "A cache-aware router for fleets of LLM engine replicas: replay policies offline, "
    "compare them under load, serve a fleet locally or on a Ray cluster."
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="prefix-router", description=DESCRIPTION)
    commands = parser.add_subparsers(dest="command", required=True)
    add_replay_parser(commands)
    add_crossover_parser(commands)
    add_calibrate_parser(commands)
    add_bench_parser(commands)
    add_deploy_commands(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.run(args) or 0)
    except (ValueError, FileNotFoundError, ReplicaStartError) as error:
        print(f"prefix-router {args.command}: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C where no command handles it: no traceback
        return 130


if __name__ == "__main__":
    sys.exit(main())
