"""Where an application's engine replicas answer: each writes its own server's URL in
Ray's key-value store (where Serve keeps its own state too) when it is ready and
removes it when Serve stops it, so that an ingress lists them (``/engines``) whatever
its request router, and a bench reads each engine's own figures there.
"""

from __future__ import annotations

from ray import serve
from ray.experimental import internal_kv

#: The namespace of Ray's key-value store the URLs are kept in, by application and
#: replica.
NAMESPACE = "prefix-router-serve"


def enter(url: str) -> None:
    """Say this replica's server's URL (from inside the replica)."""
    internal_kv._internal_kv_put(_key(), url.encode(), namespace=NAMESPACE)


def leave() -> None:
    """Take this replica's URL back (from inside the replica, as Serve stops it)."""
    internal_kv._internal_kv_del(_key(), namespace=NAMESPACE)


def engine_urls(app_name: str) -> list[str]:
    """The URLs of an application's engine replicas."""
    keys = internal_kv._internal_kv_list(f"{app_name}/", namespace=NAMESPACE)
    urls = (internal_kv._internal_kv_get(key, namespace=NAMESPACE) for key in keys)
    return sorted(url.decode() for url in urls if url)


def app_engine_urls() -> list[str]:
    """The URLs of the engine replicas of the application this replica is in."""
    return engine_urls(serve.get_replica_context().app_name)


def _key() -> str:
    context = serve.get_replica_context()
    return f"{context.app_name}/{context.replica_id.unique_id}"
