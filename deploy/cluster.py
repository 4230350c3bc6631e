"""Deployment onto a cluster started with ``ray start``: ``up``, ``status``, ``down``.

``up`` places detached, named replica actors (``replica-0`` ...) in a namespace,
spread over the nodes (Ray's SPREAD strategy), and the gateway as a detached actor
on the head node, then returns: they outlive this command. Run again with another
``--replicas``, it adds or removes replicas from the end and keeps the others (and
their caches). The gateway follows the replica actors by name, so it sees every
change.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any, cast

import httpx
import ray
import uvicorn

from deploy.names import GATEWAY_NAME, NAMESPACE, REPLICA_PREFIX
from replica.actor import ReplicaActor
from replica.api import stats as stats_codec
from replica.api.config import ReplicaConfig
from replica.api.stats import ReplicaStats
from router.app import create_app
from router.config import GatewayConfig

HEAD_RESOURCE = "node:__internal_head__"
REPLICA_CPUS = 0.01


class GatewayServer:
    """The gateway inside a Ray actor (the body of :data:`GatewayActor`)."""

    def __init__(self, config: GatewayConfig, host: str | None, port: int) -> None:
        self.config, self.host, self.port = config, host, port
        self._url: str | None = None
        self._task: asyncio.Task[None] | None = None

    async def url(self) -> str:
        if self._url is None:
            host = self.host or ray.util.get_node_ip_address()
            app = create_app(self.config, ray_replica_prefix=REPLICA_PREFIX)
            server = uvicorn.Server(
                uvicorn.Config(
                    app, host=host, port=self.port, log_level="warning", access_log=False
                )
            )
            self._task = asyncio.get_running_loop().create_task(server.serve())
            while not server.started:
                if self._task.done():
                    self._task.result()
                await asyncio.sleep(0.01)
            self._url = f"http://{host}:{self.port}"
        return self._url


GatewayActor: Any = ray.remote(max_restarts=-1)(GatewayServer)


def connect(address: str) -> None:
    ray.init(address=address, namespace=NAMESPACE, log_to_driver=False, configure_logging=False)


def replica_names() -> list[str]:
    names = [n for n in ray.util.list_named_actors() if n.startswith(REPLICA_PREFIX)]
    return sorted(names, key=lambda name: int(name.removeprefix(REPLICA_PREFIX)))


def up(
    replicas: int,
    replica: ReplicaConfig,
    gateway: GatewayConfig,
    host: str | None = None,
    port: int = 8000,
) -> tuple[str, list[str]]:
    """Scale to ``replicas`` replica actors and make sure the gateway runs.

    Returns the gateway's URL and the replicas' URLs. Requires :func:`connect`.
    """
    if replicas < 1:
        raise ValueError("up needs at least one replica")
    wanted = [f"{REPLICA_PREFIX}{i}" for i in range(replicas)]
    for name in replica_names():
        if name not in wanted:
            ray.kill(ray.get_actor(name), no_restart=True)
    handles = [
        ReplicaActor.options(
            name=name,
            lifetime="detached",
            get_if_exists=True,
            # SPREAD balances what actors hold: a token CPU share makes it count them
            # (with none it places them at random), and a restart may go to any node.
            num_cpus=REPLICA_CPUS,
            scheduling_strategy="SPREAD",
        ).remote(replica, host)
        for name in wanted
    ]
    urls = ray.get([handle.url.remote() for handle in handles], timeout=120)
    front = GatewayActor.options(
        name=GATEWAY_NAME,
        lifetime="detached",
        get_if_exists=True,
        num_cpus=0,
        resources={HEAD_RESOURCE: 0.001},  # on the head node, where clients expect it
    ).remote(gateway, host, port)
    return ray.get(front.url.remote(), timeout=120), urls


@dataclass
class ReplicaStatus:
    name: str
    node_id: str
    url: str
    healthy: bool
    requests: int | None
    token_hit_rate: float | None


def status(timeout_s: float = 10.0) -> tuple[str | None, list[ReplicaStatus]]:
    """The gateway's URL (``None`` if it is not up) and every replica's state."""
    rows: list[ReplicaStatus] = []
    for name in replica_names():
        handle = ray.get_actor(name)
        refs = [handle.url.remote(), handle.node_id.remote()]
        url, node = cast(list[str], ray.get(refs, timeout=timeout_s))
        rows.append(_probe(name, node, url, timeout_s))
    gateway: str | None = None
    if GATEWAY_NAME in ray.util.list_named_actors():
        gateway = cast(str, ray.get(ray.get_actor(GATEWAY_NAME).url.remote(), timeout=timeout_s))
    return gateway, rows


def _probe(name: str, node: str, url: str, timeout_s: float) -> ReplicaStatus:
    try:
        answer = httpx.get(f"{url}/stats", timeout=timeout_s)
        stats = stats_codec.decode(ReplicaStats, answer.content)
    except (httpx.HTTPError, ValueError):
        return ReplicaStatus(name, node, url, False, None, None)
    return ReplicaStatus(name, node, url, True, stats.requests, stats.cache.token_hit_rate)


def down() -> int:
    """Remove the gateway and every replica actor; return how many actors were removed."""
    names = replica_names() + (
        [GATEWAY_NAME] if GATEWAY_NAME in ray.util.list_named_actors() else []
    )
    for name in names:
        ray.kill(ray.get_actor(name), no_restart=True)
    return len(names)
