"""``prefix-router``: the command line. Flags and defaults come from config dataclasses."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Sequence
from typing import Any


def add_config_flags(
    parser: argparse.ArgumentParser,
    cls: type,
    prefix: str = "",
    skip: Sequence[str] = (),
    env_prefix: str | None = None,
) -> None:
    """One ``--prefix-name`` flag per scalar field of dataclass ``cls``.

    Flags default to ``None`` (their help shows the dataclass default), so
    :func:`config_overrides` returns exactly what the user gave. With ``env_prefix``
    (for Locust's configargparse parser) each flag also reads ``ENV_PREFIX_NAME``.
    """
    group = parser.add_argument_group(f"{cls.__name__} ({prefix.rstrip('-') or 'options'})")
    for field in dataclasses.fields(cls):
        if field.name in skip or field.default is dataclasses.MISSING:
            continue
        kind = type(field.default)
        if kind not in (int, float, str, bool):
            continue
        flag = f"--{prefix}{field.name.replace('_', '-')}"
        dest = _dest(prefix, field.name)
        extra: dict[str, Any] = {}
        if env_prefix is not None:
            extra["env_var"] = f"{env_prefix}{field.name}".upper()
        if kind is bool:
            action: Any = argparse.BooleanOptionalAction
            group.add_argument(flag, dest=dest, action=action, default=None, **extra)
        else:
            metavar = kind.__name__.upper()
            help_text = f"default: {field.default}"
            group.add_argument(flag, dest=dest, type=kind, metavar=metavar, help=help_text, **extra)


def config_overrides(args: argparse.Namespace, cls: type, prefix: str = "") -> dict[str, Any]:
    """The fields of ``cls`` that the user set on the command line."""
    values = {}
    for field in dataclasses.fields(cls):
        value = getattr(args, _dest(prefix, field.name), None)
        if value is not None:
            values[field.name] = value
    return values


def config_flags(values: dict[str, Any], prefix: str = "") -> list[str]:
    """The command-line flags that :func:`add_config_flags` reads back as ``values``."""
    flags = []
    for name, value in values.items():
        flag = f"--{prefix}{name.replace('_', '-')}"
        if isinstance(value, bool):
            flags.append(flag if value else f"--no-{flag[2:]}")
        else:
            flags += [flag, str(value)]
    return flags


def _dest(prefix: str, name: str) -> str:
    return f"{prefix}{name}".replace("-", "_")


def build_parser() -> argparse.ArgumentParser:
    from loadtest.bench_cli import add_bench_parser
    from loadtest.replay_cli import add_replay_parser

    parser = argparse.ArgumentParser(prog="prefix-router", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    add_replay_parser(commands)
    add_bench_parser(commands)
    add_replica_parser(commands)
    add_gateway_parser(commands)
    add_serve_parser(commands)
    add_cluster_parsers(commands)
    return parser


def add_cluster_parsers(commands: Any) -> None:
    from replica.server import ReplicaConfig
    from router.gateway import GatewayConfig

    up = commands.add_parser(
        "up",
        help="deploy (or rescale) replicas and the gateway onto a `ray start` cluster",
        description="Detached replica actors spread over the nodes, the gateway on the head node.",
    )
    up.add_argument("--address", default="auto", help="Ray cluster address (default: auto)")
    up.add_argument("--replicas", type=int, default=4)
    up.add_argument("--host", help="address to listen on (default: each node's Ray address)")
    up.add_argument("--port", type=int, default=8000, help="the gateway's port")
    add_config_flags(up, GatewayConfig)
    add_config_flags(up, ReplicaConfig, prefix="replica-", skip=("model",))
    up.set_defaults(run=run_up)
    for name, text, run in (
        ("status", "list the replicas: nodes, URLs, health, hit rates", run_status),
        ("down", "remove the gateway and the replicas", run_down),
    ):
        parser = commands.add_parser(name, help=text, description=text)
        parser.add_argument("--address", default="auto", help="Ray cluster address (default: auto)")
        parser.set_defaults(run=run)


def run_up(args: argparse.Namespace) -> int:
    from deploy import cluster
    from replica.server import ReplicaConfig
    from router.gateway import GatewayConfig

    gateway = GatewayConfig(**config_overrides(args, GatewayConfig))
    replica = ReplicaConfig(
        model=gateway.model, **config_overrides(args, ReplicaConfig, prefix="replica_")
    )
    cluster.connect(args.address)
    url, replicas = cluster.up(args.replicas, replica, gateway, args.host, args.port)
    print(f"{len(replicas)} replicas: {', '.join(replicas)}")
    print(f"gateway: {url}/v1")
    return 0


def run_status(args: argparse.Namespace) -> int:
    from deploy import cluster

    cluster.connect(args.address)
    gateway, rows = cluster.status()
    print(f"gateway: {gateway + '/v1' if gateway else 'not running'}")
    print(f"{'replica':<12} {'node':<14} {'url':<28} {'health':<8} {'requests':>8} {'hit rate':>8}")
    for row in rows:
        rate = f"{row.token_hit_rate:.1%}" if row.token_hit_rate is not None else "-"
        health = "ok" if row.healthy else "DOWN"
        line = f"{row.name:<12} {row.node_id[:12]:<14} {row.url:<28} {health:<8}"
        print(f"{line} {row.requests or 0:>8} {rate:>8}")
    return 0 if all(row.healthy for row in rows) else 1


def run_down(args: argparse.Namespace) -> int:
    from deploy import cluster

    cluster.connect(args.address)
    print(f"removed {cluster.down()} actors")
    return 0


def add_serve_parser(commands: Any) -> None:
    from replica.server import ReplicaConfig
    from router.gateway import GatewayConfig

    parser = commands.add_parser(
        "serve",
        help="the embedded deployment: local Ray, N replica actors and the gateway",
        description="Start a local Ray, N replica actors and the gateway; Ctrl-C stops all.",
    )
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    add_config_flags(parser, GatewayConfig)
    add_config_flags(parser, ReplicaConfig, prefix="replica-", skip=("model",))
    parser.set_defaults(run=run_serve)


def run_serve(args: argparse.Namespace) -> int:
    from deploy.local import serve
    from replica.server import ReplicaConfig
    from router.gateway import GatewayConfig

    gateway = GatewayConfig(**config_overrides(args, GatewayConfig))
    overrides = config_overrides(args, ReplicaConfig, prefix="replica_")
    replica = ReplicaConfig(model=gateway.model, **overrides)
    serve(args.replicas, replica, gateway, args.host, args.port)
    return 0


#: On SIGTERM or Ctrl-C a server stops accepting, lets requests in flight finish (for
#: at most this long), then exits.
GRACEFUL_SHUTDOWN_S = 30


def serve_http(app: Any, host: str, port: int) -> None:
    """Serve an ASGI app in the foreground until interrupted (quiet: no access log)."""
    import uvicorn

    uvicorn.run(
        app,
        host=host,
        port=port,
        log_level="warning",
        access_log=False,
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
    )


def add_gateway_parser(commands: Any) -> None:
    from router.gateway import GatewayConfig

    parser = commands.add_parser(
        "gateway",
        help="run the routing gateway alone, in front of OpenAI-compatible servers",
        description="The cache-aware gateway in front of --backend URLs (ours, vLLM or SGLang).",
    )
    parser.add_argument("--backend", action="append", default=[], metavar="URL", help="repeatable")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    add_config_flags(parser, GatewayConfig)
    parser.set_defaults(run=run_gateway)


def run_gateway(args: argparse.Namespace) -> int:
    from router.gateway import GatewayConfig, create_app

    config = GatewayConfig(**config_overrides(args, GatewayConfig))
    serve_http(create_app(config, args.backend), args.host, args.port)
    return 0


def add_replica_parser(commands: Any) -> None:
    from replica.server import ReplicaConfig

    parser = commands.add_parser(
        "replica",
        help="serve one simulated engine replica over HTTP, without Ray",
        description="One prefix-cached engine replica with an OpenAI-compatible API.",
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8001)
    add_config_flags(parser, ReplicaConfig)
    parser.set_defaults(run=run_replica)


def run_replica(args: argparse.Namespace) -> int:
    from replica.server import ReplicaConfig, create_app

    config = ReplicaConfig(**config_overrides(args, ReplicaConfig))
    serve_http(create_app(config), args.host, args.port)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.run(args) or 0)
    except (ValueError, FileNotFoundError) as error:
        print(f"prefix-router {args.command}: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
