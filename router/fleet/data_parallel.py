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

from replica.api.card import RANK_HEADER
from replica.api.stats import KVEventsEndpoint

__all__ = ["RANK_HEADER", "rank_endpoint", "rank_header", "rank_name"]


def rank_name(name: str, rank: int) -> str:
    """The replica id of rank ``rank`` of the server named ``name``."""
    return f"{name}#dp{rank}"


def rank_endpoint(endpoint: KVEventsEndpoint, rank: int) -> KVEventsEndpoint:
    """Where rank ``rank`` publishes, given where rank 0 does (vLLM's rule)."""
    return endpoint.of_rank(rank)


def rank_header(rank: int | None) -> bytes:
    """The header line a request to ``rank`` carries (none for a server of one engine)."""
    return b"" if rank is None else f"{RANK_HEADER}: {rank}\r\n".encode()
