"""Deployment onto a cluster started with ``ray start``: ``up``, ``status``, ``down``.

``up`` places detached, named replica actors (``replica-0`` ...) in a namespace,
spread over the nodes (Ray's SPREAD strategy), and detached gateway actors
(``gateway-0`` ...), one per node from the head node on, then returns: they outlive
this command. Run again with other ``--replicas`` or ``--gateways``, it adds or
removes actors from the end and keeps the others (and the replicas' caches). The
gateways follow the replica actors by name, so they see every change.
"""

from __future__ import annotations

from typing import cast

import httpx
import ray

from deploy.gateways import ActorStatus, gateway_names, gateway_status, start_gateways
from deploy.names import NAMESPACE, REPLICA_PREFIX, numbered
from replica.actor import ReplicaActor
from replica.api import stats as stats_codec
from replica.api.config import ReplicaConfig
from replica.api.stats import ReplicaStats
from router.config import GatewayConfig

HEAD_RESOURCE = "node:__internal_head__"
REPLICA_CPUS = 0.01


def connect(address: str) -> None:
    """Join the cluster at ``address`` (``auto``: the one started on this machine).

    Ray turns token authentication on by default, and reads the token (from
    ``~/.ray/auth_token``, ``RAY_AUTH_TOKEN`` or ``RAY_AUTH_TOKEN_PATH``) only when
    the address is ``auto``: naming the head explicitly, as an operator on another
    node must, fails with ``InvalidAuthToken``. So here a token found is used at any
    address (a cluster without authentication ignores it), unless ``RAY_AUTH_MODE``
    says otherwise.
    """
    if address != "auto":
        _use_the_token_if_there_is_one()
    try:
        ray.init(address=address, namespace=NAMESPACE, log_to_driver=False, configure_logging=False)
    except ConnectionError as error:
        if _is_authentication(error):
            raise ValueError(
                f"the Ray cluster at {address} refused this machine's authentication token "
                "(or it has none): copy the token of the head node (`ray get-auth-token` "
                "there) to ~/.ray/auth_token here, or set RAY_AUTH_TOKEN"
            ) from error
        raise


def _use_the_token_if_there_is_one() -> None:
    try:  # Ray's own rule for `auto`, applied to every address (Ray 2.52 and later)
        from ray._private.authentication.authentication_token_setup import (
            maybe_enable_token_auth_if_token_available,
        )
    except ImportError:  # a Ray without token authentication
        return
    maybe_enable_token_auth_if_token_available(warn_if_disabled=False)


def _is_authentication(error: BaseException | None) -> bool:
    while error is not None:
        if type(error).__name__ == "AuthenticationError" or "InvalidAuthToken" in str(error):
            return True
        error = error.__cause__ or error.__context__
    return False


def replica_names() -> list[str]:
    return numbered(ray.util.list_named_actors(), REPLICA_PREFIX)


def nodes_head_first() -> list[str]:
    """The ids of the cluster's live nodes, the head node first."""
    alive = [node for node in ray.nodes() if node["Alive"]]
    alive.sort(key=lambda node: (HEAD_RESOURCE not in node["Resources"], node["NodeID"]))
    return [node["NodeID"] for node in alive]


def up(
    replicas: int,
    replica: ReplicaConfig,
    gateway: GatewayConfig,
    host: str | None = None,
    port: int = 8000,
    gateways: int = 1,
) -> tuple[list[str], list[str]]:
    """Scale to ``replicas`` replica actors and ``gateways`` gateways, one per node.

    Returns the gateways' URLs and the replicas'. Requires :func:`connect`.
    """
    if replicas < 1:
        raise ValueError("up needs at least one replica")
    nodes = nodes_head_first()
    if not 1 <= gateways <= len(nodes):
        raise ValueError(
            f"--gateways {gateways}: one gateway per node, and the cluster has {len(nodes)}"
        )
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
    fronts, _ = start_gateways(
        gateway, host, [port] * gateways, nodes[:gateways], detached=True, backends=replicas
    )
    return fronts, urls


def status(timeout_s: float = 10.0) -> tuple[list[ActorStatus], list[ActorStatus]]:
    """Every gateway's state and every replica's."""
    rows: list[ActorStatus] = []
    for name in replica_names():
        handle = ray.get_actor(name)
        refs = [handle.url.remote(), handle.node_id.remote()]
        url, node = cast(list[str], ray.get(refs, timeout=timeout_s))
        rows.append(_probe(name, node, url, timeout_s))
    return gateway_status(timeout_s), rows


def _probe(name: str, node: str, url: str, timeout_s: float) -> ActorStatus:
    try:
        answer = httpx.get(f"{url}/stats", timeout=timeout_s)
        stats = stats_codec.decode(ReplicaStats, answer.content)
    except (httpx.HTTPError, ValueError):
        return ActorStatus(name, node, url, False, None, None)
    return ActorStatus(name, node, url, True, stats.requests, stats.cache.token_hit_rate)


def down() -> int:
    """Remove every gateway and replica actor; return how many actors were removed."""
    names = gateway_names() + replica_names()
    for name in names:
        ray.kill(ray.get_actor(name), no_restart=True)
    return len(names)
