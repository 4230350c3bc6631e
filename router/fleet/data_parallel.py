"""Data-parallel servers: one URL, several engines, each with a KV cache of its own.

A vLLM server started with ``--data-parallel-size N`` runs N engines behind one API
server. Routed as one replica, its cache would be N caches under one name: a prefix
held by rank 1 predicted for a request that vLLM's own balancer then sends to rank 0.
So the gateway routes such a server as N replicas, one per rank, as llm-d, Dynamo and
SGLang's gateway do: each has its own index entries and load, and a request sent to one
carries vLLM's ``X-data-parallel-rank`` header, which pins it to that engine.

What says which rank is which, as vLLM has it:

- the server's ``/metrics`` labels every engine's gauges ``engine="R"`` (how many there
  are: ``EngineCard.data_parallel_size``; and each rank's load);
- rank R publishes its KV events and answers replays where rank 0 does, each TCP port
  plus R (``ZmqEventPublisher.offset_endpoint_port``), its batches marked with the rank.
"""

from __future__ import annotations

from dataclasses import replace

from replica.api.stats import KVEventsEndpoint

#: vLLM's header that pins a request to one of a server's data-parallel engines.
RANK_HEADER = "x-data-parallel-rank"


def rank_name(name: str, rank: int) -> str:
    """The replica id of rank ``rank`` of the server named ``name``."""
    return f"{name}#dp{rank}"


def rank_endpoint(endpoint: KVEventsEndpoint, rank: int) -> KVEventsEndpoint:
    """Where rank ``rank`` publishes, given where rank 0 does (vLLM's rule)."""
    if rank == 0:
        return endpoint
    return replace(
        endpoint,
        endpoint=_offset(endpoint.endpoint, rank),
        replay_endpoint=_offset(endpoint.replay_endpoint, rank),
        load_endpoint=_offset(endpoint.load_endpoint, rank),
    )


def _offset(address: str, rank: int) -> str:
    """A ZMQ address's port plus ``rank`` (an ``ipc``/``inproc`` path suffixed
    ``_dpR``; none, or a port of 0, left as it is)."""
    if not address:
        return address
    if not address.startswith("tcp://"):
        return f"{address}_dp{rank}"
    host, _, port = address.rpartition(":")
    return address if port in ("", "0") else f"{host}:{int(port) + rank}"


def rank_header(rank: int | None) -> bytes:
    """The header line a request to ``rank`` carries (none for a server of one engine)."""
    return b"" if rank is None else f"{RANK_HEADER}: {rank}\r\n".encode()
