"""Deployment onto a cluster started with ``ray start``: ``up``, ``status``, ``down``.

``up`` places detached, named replica actors (``replica-0`` ...) in a namespace:
simulated engines spread over the nodes (Ray's SPREAD strategy); vLLM servers one per
GPU where the cluster has GPUs, else one per node (a CPU server takes every core of its
node). Then detached gateway actors (``gateway-0`` ...), one per node from the head node
on, configured from what the first replica says of itself; then it returns: they
outlive this command. Run again with other ``--replicas`` or ``--gateways``, it adds or
removes actors from the end and keeps the others (and the replicas' caches). The
gateways follow the replica actors by name, so they see every change.
"""

from __future__ import annotations

import socket
from collections.abc import Collection, Sequence
from typing import Any, cast

import httpx
import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from deploy.engines import deployment_of, replica_actor
from deploy.gateways import (
    ActorStatus,
    FleetCredentials,
    fleet_credentials,
    gateway_names,
    gateway_status,
    running_credentials,
    start_gateways,
)
from deploy.names import NAMESPACE, REPLICA_PREFIX, SCALER_NAME, numbered
from deploy.replicas import EngineSpec, ready_cards, stop_replicas
from deploy.scaler import start_scaler
from replica.api.card import EngineCard
from replica.api.engines import read_figures
from replica.api.fleet_token import bearer, fleet_token
from router.config import GatewayConfig
from router.fleet.autoscaler import AutoscaleConfig

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
        _check_reachable(address)
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
        raise ValueError(f"no Ray cluster at {address}: {NO_CLUSTER_FIX}") from error


NO_CLUSTER_FIX = "start one with `ray start --head`, or name its head with --address HEAD_IP:6379"


def _check_reachable(address: str, timeout_s: float = 3.0) -> None:
    """Fail at once where nothing listens: Ray itself retries for a minute before it
    says so."""
    host, _, port = address.rpartition(":")
    if "://" in address or not port.isdigit():
        return  # a Ray client address (ray://) or a form Ray judges itself
    try:
        socket.create_connection((host or "127.0.0.1", int(port)), timeout=timeout_s).close()
    except OSError as error:
        raise ValueError(
            f"no Ray cluster at {address} ({error.strerror or error}): {NO_CLUSTER_FIX}"
        ) from None


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
    engines: Sequence[EngineSpec],
    gateway: GatewayConfig,
    host: str | None = None,
    port: int = 8000,
    gateways: int = 1,
    keep: Collection[str] = (),
    autoscale: AutoscaleConfig | None = None,
    credentials: FleetCredentials | None = None,
) -> tuple[list[str], list[str]]:
    """Scale to a replica actor per engine of ``engines`` (they may serve several models:
    deploy/fleet.py) and ``gateways`` gateways, one per node; the gateways' fields named
    in ``keep`` (the user's flags) are not taken from the engine. A replica kept from an
    earlier ``up`` keeps its engine. ``autoscale``: a detached scaler actor grows and
    shrinks the fleet within its bounds from then on (deploy/scaler.py); without it, a
    scaler an earlier ``up`` left is removed. ``credentials``: the fleet's token and
    secret (by default those of the running gateways, else new ones).

    Returns the gateways' URLs and the replicas'. Requires :func:`connect`.
    """
    replicas = len(engines)
    if replicas < 1:
        raise ValueError("up needs at least one replica")
    nodes = nodes_head_first()
    if not 1 <= gateways <= len(nodes):
        raise ValueError(
            f"--gateways {gateways}: one gateway per node, and the cluster has {len(nodes)}"
        )
    stop_scaler()  # first: it starts no replica while this one places them
    credentials = credentials or fleet_credentials()
    wanted = [f"{REPLICA_PREFIX}{i}" for i in range(replicas)]
    for name in replica_names():
        if name not in wanted:
            ray.kill(ray.get_actor(name), no_restart=True)
    handles = _place_replicas(engines, wanted, host, nodes, credentials.token)
    timeout_s = max(getattr(engine, "startup_timeout_s", 120.0) for engine in engines)
    cards = ready_cards(handles, timeout_s=timeout_s)
    fronts, _ = start_gateways(
        gateway.configured_by(cards[0], keep),
        host,
        [port] * gateways,
        nodes[:gateways],
        detached=True,
        backends=replicas,
        credentials=credentials,
    )
    if autoscale is not None:
        _start_detached_scaler(autoscale, engines, host, fronts[0], credentials.token)
    return fronts, [card.url for card in cards]


def _place_replicas(
    engines: Sequence[EngineSpec],
    names: list[str],
    host: str | None,
    nodes: list[str],
    fleet_token: str,
) -> list[Any]:
    """A detached replica actor per engine, under ``names``: one already there is kept
    (it answers the token it was given: a later ``up`` gives the running fleet's)."""
    return [
        replica_actor(engine)
        .options(
            name=name,
            lifetime="detached",
            get_if_exists=True,
            **placement(engine, index, len(engines), nodes),
        )
        .remote(engine, host, fleet_token)
        for index, (name, engine) in enumerate(zip(names, engines, strict=True))
    ]


def _start_detached_scaler(
    autoscale: AutoscaleConfig,
    engines: Sequence[EngineSpec],
    host: str | None,
    gateway: str,
    fleet_token: str,
) -> None:
    """The scaler, placing new replicas as ``up`` places them, outliving this process."""
    options = {"num_cpus": REPLICA_CPUS, "scheduling_strategy": "SPREAD", "lifetime": "detached"}
    if deployment_of(engines[0]).takes_a_device and ray.cluster_resources().get("GPU", 0):
        options["num_gpus"] = 1
    start_scaler(autoscale, engines, host, gateway, options, detached=True, fleet_token=fleet_token)


def stop_scaler() -> bool:
    """Remove the scaler actor if there is one (its replicas stay)."""
    if SCALER_NAME not in ray.util.list_named_actors():
        return False
    ray.kill(ray.get_actor(SCALER_NAME), no_restart=True)
    return True


def placement(engine: EngineSpec, index: int, replicas: int, nodes: list[str]) -> dict[str, Any]:
    """Where replica ``index`` goes. Simulated engines: SPREAD, which balances what
    actors hold (a token CPU share makes it count them; with none it places them at
    random), and a restart may go to any node. vLLM: a GPU each where there are GPUs,
    else a node each (preferred, so that a restart after the node's loss goes elsewhere)."""
    if not deployment_of(engine).takes_a_device:
        return {"num_cpus": REPLICA_CPUS, "scheduling_strategy": "SPREAD"}
    gpus = int(ray.cluster_resources().get("GPU", 0))
    if gpus:
        if replicas > gpus:
            raise ValueError(
                f"--replicas {replicas}: one vLLM replica per GPU, and the cluster has {gpus}"
            )
        return {"num_cpus": REPLICA_CPUS, "num_gpus": 1, "scheduling_strategy": "SPREAD"}
    if replicas > len(nodes):
        raise ValueError(
            f"--replicas {replicas}: without GPUs, one vLLM replica per node "
            f"(it takes every core), and the cluster has {len(nodes)}"
        )
    affinity = NodeAffinitySchedulingStrategy(nodes[index], soft=True)
    return {"num_cpus": REPLICA_CPUS, "scheduling_strategy": affinity}


def status(timeout_s: float = 10.0) -> tuple[list[ActorStatus], list[ActorStatus]]:
    """Every gateway's state and every replica's, with how the first gateway routes it."""
    gateways = gateway_status(timeout_s)
    modes = gateways[0].backends if gateways else {}
    credentials = running_credentials()
    token = credentials.token if credentials else fleet_token()
    rows: list[ActorStatus] = []
    for name in replica_names():
        handle = ray.get_actor(name)
        try:
            card = cast(EngineCard, ray.get(handle.card.remote(), timeout=timeout_s))
            node = cast(str, ray.get(handle.node_id.remote(), timeout=timeout_s))
        except (ray.exceptions.RayError, TimeoutError):
            rows.append(ActorStatus(name, "?", "?", False, None, None))
            continue
        rows.append(_probe(name, node, card, timeout_s, modes.get(name), token))
    return gateways, rows


def _probe(
    name: str, node: str, card: EngineCard, timeout_s: float, routing: str | None, token: str
) -> ActorStatus:
    """A replica's health and figures: ours from their ``/stats``, vLLM from ``/metrics``
    (asked with the fleet's ``token``)."""
    try:
        with httpx.Client(timeout=timeout_s, headers=bearer(token)) as client:
            figures = read_figures(client, card.url)
    except (httpx.HTTPError, ValueError):
        return ActorStatus(name, node, card.url, False, None, None, routing)
    return ActorStatus(
        name,
        node,
        card.url,
        True,
        figures.requests,
        figures.token_hit_rate,
        routing,
        role=card.role,
    )


def down() -> int:
    """Remove every gateway and replica actor; return how many actors were removed. The
    replicas are stopped first, so that a vLLM server ends with its files removed."""
    scaler = stop_scaler()  # first: it starts no replica while they go
    gateways, replicas = gateway_names(), replica_names()
    for name in gateways:
        ray.kill(ray.get_actor(name), no_restart=True)
    stop_replicas([ray.get_actor(name) for name in replicas])
    return len(gateways) + len(replicas) + scaler
