"""``prefix-router serve``: the embedded default deployment, in the foreground.

Starts a local Ray instance (bound to 127.0.0.1), N replica actors and the gateway in
this process. Ctrl-C (or SIGTERM) stops the gateway, the actors and Ray, in that order.
"""

from __future__ import annotations

import os

import ray

from deploy.names import NAMESPACE, REPLICA_PREFIX
from deploy.serving import serve_http
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
) -> None:
    """Run until interrupted; everything started here is stopped on the way out."""
    if replicas < 1:
        raise ValueError("serve needs at least one replica")
    start_local_ray()
    actors = []
    try:
        actors = [
            ReplicaActor.options(name=f"{REPLICA_PREFIX}{i}", num_cpus=0).remote(replica, host)
            for i in range(replicas)
        ]
        urls = ray.get([actor.url.remote() for actor in actors])
        print(f"{replicas} replicas: {', '.join(urls)}", flush=True)
        print(f"gateway: http://{host}:{port}/v1 (policy {gateway.policy})", flush=True)
        app = create_app(gateway, ray_replica_prefix=REPLICA_PREFIX)
        serve_http(app, host, port)
    finally:
        for actor in actors:
            ray.kill(actor, no_restart=True)
        ray.shutdown()
