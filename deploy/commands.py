"""The deployments' commands: ``replica``, ``gateway``, ``serve``, ``up``, ``status``,
``down``, ``serve-config`` (Ray Serve) and ``tiny-model``, registered on the command
line by ``prefix_router/cli.py``.

Flags and defaults come from the config dataclasses (see ``deploy/flags.py``). What
starts Ray is imported only by the commands that need it, so ``replay`` starts fast.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from deploy.engines import DEPLOYMENTS, SHARED_WITH_REPLICAS
from deploy.flags import (
    add_config_flags,
    add_engine_flags,
    config_from_args,
    config_overrides,
)
from deploy.fleet import FLEET_HELP, PD_HELP, fleet_engines, parse_entry, scaling_text
from deploy.replicas import EngineSpec
from deploy.serving import (
    PortBusyError,
    collect_garbage_rarely,
    listening_socket,
    serve_http,
    serve_workers,
)
from replica.api.config import ReplicaConfig
from replica.api.engines import ENGINES
from replica.api.fleet_token import ENV_FLEET_TOKEN, fleet_token
from replica.api.model_tokenizer import load_tokenizer
from replica.tiny_model import TinyModelConfig, write_tiny_model
from router.config import GatewayConfig
from router.fleet.autoscaler import AutoscaleConfig


def add_deploy_commands(commands: Any) -> None:
    """Register the deployments' commands on the command line's ``commands``."""
    add_replica_parser(commands)
    add_gateway_parser(commands)
    add_serve_parser(commands)
    add_cluster_parsers(commands)
    add_serve_config_parser(commands)
    add_tiny_model_parser(commands)


def add_pd_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prefill", type=int, default=0, metavar="N", help=PD_HELP)
    parser.add_argument("--decode", type=int, default=0, metavar="M", help=PD_HELP)


def add_fleet_flags(parser: argparse.ArgumentParser) -> None:
    """The gateway's flags, the engine's, and the simulated replicas' as ``--replica-*``
    (they serve its model with its tokenizer)."""
    add_engine_flags(parser, {name: kind.summary for name, kind in ENGINES.items()})
    add_config_flags(parser, GatewayConfig)
    add_config_flags(parser, ReplicaConfig, prefix="replica-", skip=SHARED_WITH_REPLICAS)


def fleet_configs(args: argparse.Namespace) -> tuple[GatewayConfig, EngineSpec, frozenset[str]]:
    """The gateway's configuration, the replicas' engine, and the gateway's fields the
    user set (the rest follow what the engine says of itself)."""
    gateway = config_from_args(GatewayConfig, args)
    keep = frozenset(_names(config_overrides(args, GatewayConfig)))
    if getattr(args, "fleet", None) and "model" not in keep:  # the first entry's, by default
        gateway = replace(gateway, model=parse_entry(args.fleet[0]).model)
        keep |= {"model"}
    deployment = DEPLOYMENTS[args.engine]
    if deployment.kind.loads_model and Path(gateway.model).is_dir():
        # a folder: the same for every process, wherever run
        gateway = replace(gateway, model=str(Path(gateway.model).resolve()))
    return gateway, deployment.spec_from_args(args, gateway, keep), keep


def _names(overrides: Mapping[str, Any]) -> list[str]:
    """The field names in a nested dict of overrides (``routing.block_size`` as ``block_size``)."""
    names = []
    for key, value in overrides.items():
        names += _names(value) if isinstance(value, Mapping) else [key]
    return names


ADDRESS_HELP = (
    "the Ray cluster: auto (the one started on this machine) or the head's HOST:PORT; "
    "with Ray's token authentication the token is read from ~/.ray or RAY_AUTH_TOKEN"
)


def add_serve_config_parser(commands: Any) -> None:
    from deploy.ray_serve.batching import DEFAULT_INTERVAL_MS
    from deploy.ray_serve.config import ROUTERS  # no Ray Serve: only the names

    parser = commands.add_parser(
        "serve-config",
        help="write a Ray Serve config for our replicas routed by our policies, or run it",
        description="A Serve config file (deploy/ray_serve/): our simulated engines as a "
        "Serve deployment, behind an OpenAI-compatible ingress, routed by prefix-router's "
        "request router (or Serve's, to compare). Run it with `serve run FILE`, or deploy "
        "it onto a `ray start` cluster with `serve deploy FILE`.",
    )
    parser.add_argument("--router", choices=list(ROUTERS), default="prefix")
    parser.add_argument(
        "--replicas", type=int, default=2, help="engines (the least, with --max-replicas)"
    )
    parser.add_argument(
        "--max-replicas",
        type=int,
        default=0,
        help="let Serve's autoscaler grow the engines up to this many (default: a fixed count)",
    )
    parser.add_argument("--host", default="127.0.0.1", help="Serve's HTTP proxy's address")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument(
        "--stream-batching-interval-ms",
        type=float,
        default=DEFAULT_INTERVAL_MS,
        help="gather a streamed answer's tokens after the first for this long before "
        "passing them through Serve as one item, as Ray Serve LLM does (0: each token "
        f"apart; default: {DEFAULT_INTERVAL_MS:g})",
    )
    parser.add_argument("-o", "--output", default="-", help="the file to write (default: stdout)")
    parser.add_argument(
        "--run",
        action="store_true",
        dest="run_it",
        help="then run it in the foreground (`serve run FILE`)",
    )
    add_config_flags(parser, GatewayConfig)
    add_config_flags(parser, ReplicaConfig, prefix="replica-", skip=SHARED_WITH_REPLICAS)
    parser.set_defaults(run=run_serve_config)


def run_serve_config(args: argparse.Namespace) -> int:
    import os
    import tempfile

    from deploy.ray_serve.config import ServeApp

    app = ServeApp(
        router=args.router,
        router_kwargs=config_overrides(args, GatewayConfig) if args.router == "prefix" else {},
        engine=config_overrides(args, ReplicaConfig, prefix="replica_"),
        replicas=args.replicas,
        autoscaling={"max_replicas": args.max_replicas} if args.max_replicas else {},
        host=args.host,
        port=args.port,
        stream_batching_interval_ms=args.stream_batching_interval_ms,
    )
    if args.output == "-" and not args.run_it:
        sys.stdout.write(app.yaml())
        return 0
    path = args.output
    if path == "-":
        path = os.path.join(tempfile.mkdtemp(prefix="prefix-router-serve-"), "serve_config.yaml")
    Path(path).write_text(app.yaml())
    print(f"serve-config: wrote {path}", file=sys.stderr)
    if not args.run_it:
        return 0
    serve = os.path.join(os.path.dirname(sys.executable), "serve")
    os.execv(serve, [serve, "run", path])  # Serve's own command, in the foreground


def add_cluster_parsers(commands: Any) -> None:
    up = commands.add_parser(
        "up",
        help="deploy (or rescale) replicas and gateways onto a `ray start` cluster",
        description="Detached replica actors spread over the nodes, and gateways, one per "
        "node from the head node on.",
    )
    up.add_argument("--address", default="auto", help=ADDRESS_HELP)
    up.add_argument("--replicas", type=int, default=4)
    up.add_argument("--fleet", action="append", default=[], metavar="MODEL=N", help=FLEET_HELP)
    add_pd_flags(up)
    up.add_argument("--gateways", type=int, default=1, help="one per node (default: 1)")
    up.add_argument("--host", help="address to listen on (default: each node's Ray address)")
    up.add_argument("--port", type=int, default=8000, help="the gateways' port")
    add_open_replicas_flag(up)
    add_fleet_flags(up)
    add_config_flags(up, AutoscaleConfig)
    up.set_defaults(run=run_up)
    for name, text, run in (
        ("status", "list the gateways and replicas: nodes, URLs, health, hit rates", run_status),
        ("down", "remove the gateways and the replicas", run_down),
    ):
        parser = commands.add_parser(name, help=text, description=text)
        parser.add_argument("--address", default="auto", help=ADDRESS_HELP)
        parser.set_defaults(run=run)


def run_up(args: argparse.Namespace) -> int:
    from deploy import cluster
    from deploy.gateways import fleet_credentials, keep_token

    gateway, engine, keep = fleet_configs(args)
    cluster.connect(args.address)
    engines = fleet_engines(args.fleet, args.replicas, engine, args.prefill, args.decode)
    autoscale = autoscale_config(args)
    credentials = fleet_credentials(args.open_replicas)
    gateways, replicas = cluster.up(
        engines, gateway, args.host, args.port, args.gateways, keep, autoscale, credentials
    )
    print(f"{len(replicas)} replicas: {', '.join(replicas)}")
    token_file = keep_token(credentials.token, "up")
    if credentials.token:
        where = f"in {token_file}" if token_file else f"${ENV_FLEET_TOKEN}'s"
        print(f"replicas answer only requests carrying the fleet's token ({where})")
    else:
        print("replicas answer anyone (--open-replicas): keep them off every network")
    if autoscale is not None:
        print(scaling_text(autoscale, engines))
    for url in gateways:
        print(f"gateway: {url}/v1")
    return 0


def run_status(args: argparse.Namespace) -> int:
    from deploy import cluster

    cluster.connect(args.address)
    gateways, replicas = cluster.status()
    if not gateways:
        print("gateway: not running")
    print(
        f"{'actor':<12} {'node':<14} {'url':<28} {'role':<8} {'health':<8} {'requests':>8} "
        f"{'hit rate':>8}  routing"
    )
    for row in [*gateways, *replicas]:
        rate = f"{row.token_hit_rate:.1%}" if row.token_hit_rate is not None else "-"
        health = "ok" if row.healthy else "DOWN"
        line = f"{row.name:<12} {row.node_id[:12]:<14} {row.url:<28} {row.role:<8} {health:<8}"
        print(f"{line} {row.requests or 0:>8} {rate:>8}  {row.routing or ''}".rstrip())
    return 0 if all(row.healthy for row in [*gateways, *replicas]) else 1


def run_down(args: argparse.Namespace) -> int:
    from deploy import cluster

    cluster.connect(args.address)
    print(f"removed {cluster.down()} actors")
    return 0


def add_serve_parser(commands: Any) -> None:
    parser = commands.add_parser(
        "serve",
        help="the embedded deployment: local Ray, N replica actors and the gateway",
        description="Start a local Ray, N replica actors and the gateway; Ctrl-C stops all.",
    )
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--fleet", action="append", default=[], metavar="MODEL=N", help=FLEET_HELP)
    add_pd_flags(parser)
    parser.add_argument(
        "--gateways",
        "--workers",
        type=int,
        default=1,
        dest="gateways",
        metavar="N",
        help="gateway processes, routing as one (default: 1, in this process; more are "
        "Ray actors sharing --port, as `gateway --workers` shares it, or on --port, "
        "--port+1, ... with --separate-ports)",
    )
    parser.add_argument("--separate-ports", action="store_true")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    add_open_replicas_flag(parser)
    add_fleet_flags(parser)
    add_config_flags(parser, AutoscaleConfig)
    parser.set_defaults(run=run_serve)


def run_serve(args: argparse.Namespace) -> int:
    from deploy.local import serve

    gateway, engine, keep = fleet_configs(args)
    autoscale = autoscale_config(args)
    serve(
        fleet_engines(args.fleet, args.replicas, engine, args.prefill, args.decode),
        gateway,
        args.host,
        args.port,
        args.gateways,
        args.separate_ports,
        keep,
        autoscale,
        args.open_replicas,
    )
    return 0


def add_open_replicas_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--open-replicas",
        action="store_true",
        help="replicas that answer anyone, not only the fleet's token: for a router "
        "that sends its workers no credential (vLLM's router in P/D mode)",
    )


def autoscale_config(args: argparse.Namespace) -> AutoscaleConfig | None:
    """The fleet's bounds and targets, when ``--min-replicas`` and ``--max-replicas``
    let it scale (``None``: a fixed fleet of ``--replicas``); a disaggregated fleet's
    pools each start within them and scale apart."""
    config = config_from_args(AutoscaleConfig, args)
    if config.fixed:
        return None
    if args.fleet:
        raise ValueError(
            "--min-replicas and --max-replicas scale a fleet of one model, not --fleet"
        )
    low, high = config.min_replicas, config.max_replicas
    pools = {"--prefill": args.prefill, "--decode": args.decode}
    if not (args.prefill or args.decode):
        pools = {"--replicas": args.replicas}
    for flag, count in pools.items():
        if not low <= count <= high:
            raise ValueError(
                f"{flag} {count} must lie within --min-replicas {low} and --max-replicas {high}"
            )
    return config


def add_tiny_model_parser(commands: Any) -> None:
    parser = commands.add_parser(
        "tiny-model",
        help="write a small randomly initialised Llama and its tokenizer (no download)",
        description="A Hugging Face model folder that vLLM serves as any Llama: random "
        "weights, a byte-level BPE tokenizer trained here, Llama 3's chat template.",
    )
    parser.add_argument("folder", type=Path)
    add_config_flags(parser, TinyModelConfig)
    parser.set_defaults(run=run_tiny_model)


def run_tiny_model(args: argparse.Namespace) -> int:
    config = config_from_args(TinyModelConfig, args)
    folder = write_tiny_model(args.folder, config)
    print(
        f"wrote {folder}: a Llama of {config.parameters / 1e6:.1f} M parameters, "
        f"vocabulary {config.vocab_size}"
    )
    print(f"serve it: prefix-router serve --engine vllm --model {folder}")
    return 0


def check_tokenizer(config: GatewayConfig | ReplicaConfig) -> None:
    """Refuse a tokenizer that cannot load here, before any server starts with it."""
    load_tokenizer(config.tokenizer, config.chat_template)


def add_gateway_parser(commands: Any) -> None:
    parser = commands.add_parser(
        "gateway",
        help="run the routing gateway alone, in front of OpenAI-compatible servers",
        description="The cache-aware gateway in front of --backend URLs (ours, vLLM or SGLang).",
    )
    parser.add_argument(
        "--backend",
        action="append",
        default=[],
        metavar="URL[,kv=tcp://HOST:PORT,replay=tcp://HOST:PORT,topic=T][,role=R]",
        help="repeatable; a vLLM server started with --kv-events-config: its URL and "
        "the config's endpoint, replay_endpoint and topic, reached from here; role= "
        "prefill or decode for a disaggregated fleet's server that does not say its own",
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument(
        "--workers",
        type=int,
        default=1,
        help="gateway processes sharing --port (SO_REUSEPORT), each routing as one of "
        "several gateways do (default: 1)",
    )
    add_config_flags(parser, GatewayConfig)
    parser.set_defaults(run=run_gateway)


def run_gateway(args: argparse.Namespace) -> int:
    from router.fleet.backends import parse_backend

    config = config_from_args(GatewayConfig, args)
    check_tokenizer(config)
    for spec in args.backend:
        parse_backend(spec)  # refuse a bad one before serving
    if args.workers < 1:
        raise ValueError(f"--workers {args.workers}: at least one")
    if args.workers == 1:
        gateway_worker(config, args.backend, args.host, args.port, False)
        return 0
    listening_socket(args.host, args.port).close()  # a busy port said once, here
    return serve_workers(
        gateway_worker, (config, args.backend, args.host, args.port, True), args.workers
    )


def gateway_worker(
    config: GatewayConfig, backends: list[str], host: str, port: int, reuse_port: bool
) -> None:
    """One gateway process: ``gateway`` itself, or one of its ``--workers`` (spawned,
    so a module's function, given its arguments)."""
    from router.http.app import create_app

    try:
        app = create_app(config, backends)
        collect_garbage_rarely()
        serve_http(app, host, port, reuse_port)
    except PortBusyError as error:
        if not reuse_port:
            raise
        print(f"error: {error}", file=sys.stderr)  # a worker's: said as the command says it
        sys.exit(2)


def add_replica_parser(commands: Any) -> None:
    parser = commands.add_parser(
        "replica",
        help="serve one simulated engine replica over HTTP, without Ray",
        description="One prefix-cached engine replica with an OpenAI-compatible API.",
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8001)
    parser.add_argument(
        "--fleet-token-file",
        default="",
        metavar="FILE",
        help="answer only requests carrying the token this file holds (as a bearer "
        f"token), but /health; default: ${ENV_FLEET_TOKEN}, else anyone's",
    )
    add_config_flags(parser, ReplicaConfig)
    parser.set_defaults(run=run_replica)


def run_replica(args: argparse.Namespace) -> int:
    from replica.server import create_app

    config = config_from_args(ReplicaConfig, args)
    check_tokenizer(config)
    token = fleet_token(args.fleet_token_file)
    app = create_app(config, kv_events_host=args.host, fleet_token=token)
    serve_http(app, args.host, args.port)
    return 0
