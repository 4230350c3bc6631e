"""Gateways as Ray actors: several processes that route as one.

Each gateway actor runs the gateway's HTTP server in its own event loop and process,
and follows the replica actors by name. It starts serving as it is constructed, so
that when its process dies (``kill -9``, an out-of-memory kill) the actor Ray restarts
takes its port again with no one to ask it: meanwhile the kernel gives new
connections to the other gateways on the port, and the new process learns the caches
from the replicas' replay buffers as it subscribes (``router/index/kv_subscriber.py``).

They agree without talking to each other: every gateway subscribes to every replica's
KV events and load reports, so each has the same index and sees the load the others
send (``router/fleet/load.py``).

On one machine the gateways share one port (SO_REUSEPORT: the kernel spreads new
connections over them) or take consecutive ports; on a cluster, ``up`` places one
per node.
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, cast

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from deploy.names import GATEWAY_PREFIX, REPLICA_PREFIX, numbered
from deploy.serving import PortBusyError, listening_socket, serve_in_loop
from replica.api import stats as stats_codec
from replica.api.fleet_token import fleet_token
from router.config import GatewayConfig
from router.fair.tenants import fleet_secret
from router.http.app import create_app
from router.stats import BackendStats, GatewayStats


class GatewayServer:
    """The gateway inside a Ray actor (the body of :data:`GatewayActor`)."""

    def __init__(
        self,
        config: GatewayConfig,
        host: str | None,
        port: int,
        reuse_port: bool = True,
        credentials: FleetCredentials | None = None,
    ) -> None:
        self.config, self.host, self.port, self.reuse_port = config, host, port, reuse_port
        #: The fleet's token and secret: every gateway of the fleet has the same
        #: (:func:`start_gateways`), so they reach the replicas and salt a tenant alike.
        self.credentials = credentials or FleetCredentials("", b"")
        self._app: Any = None
        self._task: asyncio.Task[None] | None = None
        # Ray runs an async actor's constructor in the actor's event loop: the server
        # starts as soon as the loop runs, in the first process or a restarted one.
        self._serving = asyncio.get_running_loop().create_task(self._serve())

    async def _serve(self) -> str:
        host = self.host or ray.util.get_node_ip_address()
        self._app = create_app(
            self.config,
            ray_replica_prefix=REPLICA_PREFIX,
            secret=self.credentials.secret,
            fleet_token=self.credentials.token,
        )
        sock = listening_socket(host, self.port, self.reuse_port)
        _, self._task = await serve_in_loop(self._app, host, self.port, sock)
        return f"http://{host}:{self.port}"

    async def url(self) -> str:
        """Its base URL once it serves; what stopped it from serving, raised."""
        return await asyncio.shield(self._serving)

    async def stats(self) -> dict[str, Any]:
        """Its ``/stats``, asked through Ray: gateways sharing a port cannot be told
        apart over HTTP."""
        await self.url()
        return stats_codec.encode(self._app.state.gateway.stats())

    async def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    async def fleet_credentials(self) -> FleetCredentials:
        """For a gateway or replica started beside it (inside the Ray cluster only)."""
        return self.credentials

    async def ready(self, backends: int) -> None:
        """Once it routes to ``backends`` replicas (it finds the actors by name, a
        moment after it starts): a gateway that answered 503 would not be ready."""
        await self.url()
        pool = self._app.state.gateway.pool
        while len(pool.backends) < backends:
            await asyncio.sleep(0.05)


GatewayActor: Any = ray.remote(max_restarts=-1)(GatewayServer)


def gateway_names() -> list[str]:
    return numbered(ray.util.list_named_actors(), GATEWAY_PREFIX)


def start_gateways(
    config: GatewayConfig,
    host: str | None,
    ports: list[int],
    nodes: Sequence[str] = (),
    detached: bool = False,
    backends: int = 0,
    credentials: FleetCredentials | None = None,
) -> tuple[list[str], list[Any]]:
    """Gateways ``gateway-0`` .. ``gateway-{len(ports)-1}`` (those running stay, the
    ones beyond are removed), gateway ``i`` on ``ports[i]`` and, given ``nodes``, on
    node ``nodes[i]``, each routing to ``backends`` replicas when this returns, with
    the fleet's ``credentials`` (by default :func:`fleet_credentials`). Returns their
    URLs and handles (an actor that is not detached lives as long as a handle to it)."""
    credentials = credentials or fleet_credentials()
    for name in gateway_names()[len(ports) :]:
        ray.kill(ray.get_actor(name), no_restart=True)
    handles = []
    for i, port in enumerate(ports):
        node = nodes[i] if i < len(nodes) else None
        placement = NodeAffinitySchedulingStrategy(node, soft=False) if node else "DEFAULT"
        handles.append(
            GatewayActor.options(
                name=f"{GATEWAY_PREFIX}{i}",
                get_if_exists=True,
                num_cpus=0,
                scheduling_strategy=placement,
                **({"lifetime": "detached"} if detached else {}),
            ).remote(config, host, port, True, credentials)
        )
    urls = [_listening(handle, port) for handle, port in zip(handles, ports, strict=True)]
    ray.get([handle.ready.remote(backends) for handle in handles], timeout=120)
    return urls, handles


@dataclass(frozen=True)
class FleetCredentials:
    """What a fleet's parts share: the token its replicas ask of every caller
    (replica/api/fleet_token.py), and the secret its gateways key tenants' salts with
    (router/fair/tenants.py), which never leaves the gateways."""

    token: str
    secret: bytes

    def __repr__(self) -> str:  # never in a log or a traceback
        return "FleetCredentials(token=..., secret=...)"


def fleet_credentials(open_replicas: bool = False) -> FleetCredentials:
    """Those of the gateways already running (a later ``up`` adds to a fleet), else the
    operator's (``$PREFIX_ROUTER_FLEET_TOKEN``, ``$PREFIX_ROUTER_FLEET_SECRET``), else
    new ones. ``open_replicas``: no token (the replicas answer anyone)."""
    running = running_credentials()
    if running is not None:
        return replace(running, token="") if open_replicas else running
    token = "" if open_replicas else fleet_token() or secrets.token_urlsafe(32)
    return FleetCredentials(token, fleet_secret() or secrets.token_hex(32).encode())


def running_credentials() -> FleetCredentials | None:
    """The running gateways' credentials (``None``: no gateway runs)."""
    running = gateway_names()
    if not running:
        return None
    gateway = ray.get_actor(running[0])
    return cast(FleetCredentials, ray.get(gateway.fleet_credentials.remote(), timeout=60))


def keep_token(token: str, name: str) -> Path | None:
    """Where the user finds a token ``serve`` or ``up`` made: a file only they can read,
    ``~/.prefix-router/fleet-token-NAME`` (``None``: no token, or the operator's own,
    from ``$PREFIX_ROUTER_FLEET_TOKEN``, which stays there)."""
    if not token or fleet_token() == token:
        return None
    folder = Path.home() / ".prefix-router"
    folder.mkdir(mode=0o700, exist_ok=True)
    path = folder / f"fleet-token-{name}"
    path.touch(mode=0o600)
    path.chmod(0o600)
    path.write_text(token + "\n")
    return path


def _listening(handle: Any, port: int) -> str:
    """The gateway's URL once it listens; a gateway that cannot take its port is
    removed and its reason raised as the user's error it is (not Ray's traceback)."""
    try:
        return cast(str, ray.get(handle.url.remote(), timeout=120))
    except ray.exceptions.RayTaskError as error:
        ray.kill(handle, no_restart=True)
        if isinstance(error.cause, PortBusyError):
            raise PortBusyError(str(error.cause)) from None
        raise


@dataclass
class ActorStatus:
    """A gateway or replica actor, as ``prefix-router status`` lists it."""

    name: str
    node_id: str
    url: str
    healthy: bool
    requests: int | None
    token_hit_rate: float | None
    #: A replica: how the first gateway routes it (``precise``, ``approximate: why``).
    routing: str | None = None
    #: A gateway: that, for each replica it routes, by name.
    backends: dict[str, str] = field(default_factory=dict)
    #: A replica's role (``both``, ``prefill``, ``decode``); ``-`` for a gateway.
    role: str = "-"


def gateway_status(timeout_s: float = 10.0) -> list[ActorStatus]:
    rows = []
    for name in gateway_names():
        handle = ray.get_actor(name)
        try:
            url, node, raw = ray.get(  # type: ignore[var-annotated]
                [handle.url.remote(), handle.node_id.remote(), handle.stats.remote()],
                timeout=timeout_s,
            )
        except (ray.exceptions.RayError, TimeoutError):
            rows.append(ActorStatus(name, "?", "?", False, None, None))
            continue
        stats = stats_codec.decode(GatewayStats, raw)
        routes: dict[str, str] = {}
        for backend in stats.backends:  # a data-parallel server's ranks on one line
            server, text = backend.server or backend.replica_id, routing_text(backend)
            if backend.data_parallel_rank is not None:
                text = f"dp{backend.data_parallel_rank} {text}"
            routes[server] = f"{routes[server]}; {text}" if server in routes else text
        totals = stats.totals
        rows.append(
            ActorStatus(name, node, url, True, totals.requests, totals.token_hit_rate, None, routes)
        )
    return rows


def routing_text(backend: BackendStats) -> str:
    """How a gateway routes a backend, in a few words (and why, when approximately)."""
    if backend.routing_mode == "approximate":
        return f"approximate: {backend.approximate_reason}"
    return backend.routing_mode
