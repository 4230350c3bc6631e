"""``prefix-router serve``: the embedded default deployment, in the foreground.

Starts a local Ray instance (bound to 127.0.0.1), N replica actors and the gateway:
one in this process, or several as Ray actors (``deploy/gateways.py``) sharing the
port or on consecutive ports. Ctrl-C (or SIGTERM) stops the gateways, the actors and
Ray, in that order.
"""

from __future__ import annotations

import os
import signal
import threading

import ray

from deploy.gateways import start_gateways
from deploy.names import NAMESPACE, REPLICA_PREFIX
from deploy.serving import listening_socket, serve_http
from replica.actor import ReplicaActor
from replica.api.config import ReplicaConfig
from router.app import create_app
from router.config import GatewayConfig


def start_local_ray(num_cpus: int | None = None) -> None:
    # A single-machine Ray binds to loopback only when it is told it is no cluster.
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    ray.init(
        num_cpus=num_cpus,
        namespace=NAMESPACE,
        include_dashboard=False,
        _node_ip_address="127.0.0.1",
        object_store_memory=100 * 1024 * 1024,
        log_to_driver=False,
        configure_logging=False,
    )


def serve(
    replicas: int,
    replica: ReplicaConfig,
    gateway: GatewayConfig,
    host: str = "127.0.0.1",
    port: int = 8000,
    gateways: int = 1,
    separate_ports: bool = False,
) -> None:
    """Run until interrupted; everything started here is stopped on the way out."""
    if replicas < 1 or gateways < 1:
        raise ValueError("serve needs at least one replica and one gateway")
    # The port first: a busy one fails at once, and Ray's processes cannot take it.
    sock = listening_socket(host, port) if gateways == 1 else None
    start_local_ray()
    actors = []
    try:
        actors = [
            ReplicaActor.options(name=f"{REPLICA_PREFIX}{i}", num_cpus=0).remote(replica, host)
            for i in range(replicas)
        ]
        urls = ray.get([actor.url.remote() for actor in actors])
        print(f"{replicas} replicas: {', '.join(urls)}", flush=True)
        if gateways == 1:
            print(f"gateway: http://{host}:{port}/v1 (policy {gateway.policy})", flush=True)
            serve_http(
                create_app(gateway, ray_replica_prefix=REPLICA_PREFIX), host, port, sock=sock
            )
            return
        ports = [port + i if separate_ports else port for i in range(gateways)]
        fronts, gateway_actors = start_gateways(gateway, host, ports, backends=replicas)
        actors += gateway_actors  # held until the end: an actor lives as long as its handle
        for url in fronts:
            print(f"gateway: {url}/v1 (policy {gateway.policy})", flush=True)
        _wait_for_a_signal()
    finally:
        for actor in actors:
            ray.kill(actor, no_restart=True)
        ray.shutdown()
        if sock is not None:
            sock.close()


def _wait_for_a_signal() -> None:
    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.set())
    stop.wait()
