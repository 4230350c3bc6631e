"""A replica's ``GET /stats``, typed: what the bench, ``prefix-router status`` and
the tests read of a replica, by attribute rather than by string key.

``encode`` and ``decode`` are the one codec: a replica answers with ``encode``, a
reader gets a typed value back with ``decode``, which names any field that is
missing or of the wrong type.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, replace
from typing import Any, TypeVar

from pydantic import TypeAdapter

from replica.api.config import ReplicaConfig
from replica.api.token_cache import TokenCacheStats

T = TypeVar("T")


@dataclass(frozen=True)
class CacheFigures:
    """The prefix cache since the last reset: queries and hits in prompt tokens and in
    full prompt blocks, blocks stored and evicted, and how full it is now. Hits count
    both tiers (as vLLM's ``cached_tokens`` does); ``host_hit_tokens`` of them were
    loaded from the host tier."""

    query_tokens: int
    hit_tokens: int
    query_blocks: int
    hit_blocks: int
    stored_blocks: int
    evictions: int
    num_blocks: int
    cached_blocks: int
    #: Fraction of blocks pinned by requests (cached idle blocks count as available).
    usage: float
    #: Hits over queries; ``None`` before the first query.
    token_hit_rate: float | None
    block_hit_rate: float | None
    #: The host tier (all zero without one) and the KV bytes moved each way.
    host_hit_tokens: int = 0
    host_num_blocks: int = 0
    host_cached_blocks: int = 0
    host_evictions: int = 0
    bytes_to_host: int = 0
    bytes_to_gpu: int = 0


@dataclass(frozen=True)
class TransferFigures:
    """KV that moved since the replica started: pulled in (from a peer or a prefill
    replica), lent out, and what failed (replica/kv_transfer.py, replica/peers.py)."""

    pulls: int = 0
    pulled_tokens: int = 0
    #: Seconds its link was busy pulling (simulated).
    pull_s: float = 0.0
    lent_blocks: int = 0
    #: Holds that ended before any decode replica pulled them.
    hold_timeouts: int = 0
    #: Pulls the peer could not serve (gone, evicted, unreachable): computed here instead.
    pull_fallbacks: int = 0


@dataclass(frozen=True)
class KVEventsEndpoint:
    """Where a replica publishes its KV events and load (ZMQ, as vLLM's publisher)."""

    endpoint: str  # PUB: (topic, 8-byte batch number, msgpack KVEventBatch)
    replay_endpoint: str  # ROUTER: send a batch number, get the batches from it on
    topic: str
    #: PUB: the load on topic ``load`` at least every 50 ms, the stream's heartbeat.
    load_endpoint: str = ""

    def of_rank(self, rank: int) -> KVEventsEndpoint:
        """Where data-parallel rank ``rank`` of the same server publishes, this being
        rank 0's: each TCP port plus ``rank``, as vLLM's ``offset_endpoint_port`` has it
        (an ``ipc``/``inproc`` path suffixed ``_dpR``; none, or a port of 0, left as it is)."""
        if rank == 0:
            return self
        return replace(
            self,
            endpoint=_offset(self.endpoint, rank),
            replay_endpoint=_offset(self.replay_endpoint, rank),
            load_endpoint=_offset(self.load_endpoint, rank),
        )


def _offset(address: str, rank: int) -> str:
    if not address:
        return address
    if not address.startswith("tcp://"):
        return f"{address}_dp{rank}"
    host, _, port = address.rpartition(":")
    return address if port in ("", "0") else f"{host}:{int(port) + rank}"


@dataclass(frozen=True)
class LoadReport:
    """A replica's load, published at least every 50 ms and on change."""

    running: int
    waiting: int
    #: Prompt tokens admitted or waiting that are not computed yet.
    prefill_tokens: int
    #: KV event batches published so far: a subscriber that has seen fewer has a gap
    #: to replay, even while no new batch comes.
    batches: int = 0
    #: When the load became this (the replica's wall clock): a gateway adds its own
    #: requests dispatched since, which the replica may not have seen yet.
    ts: float = 0.0
    #: KV blocks a new request could be given now, free or cached and unused (``None``:
    #: not said): a request needing more waits for running ones to finish.
    free_blocks: int | None = None
    #: LoRA adapters in its GPU slots, the least recently used first (``None``: not said):
    #: a request under another waits for a slot and the adapter's copy.
    adapters: tuple[str, ...] | None = None
    #: Of its slots, those another adapter could take now (empty, or its adapter idle).
    free_adapter_slots: int | None = None


@dataclass(frozen=True)
class ReplicaStats:
    """One replica now: its configuration, what it served, its queues and its cache."""

    model: str
    pid: int
    config: ReplicaConfig
    #: Requests accepted and refused (400) since the last reset.
    requests: int
    errors: int
    running: int
    waiting: int
    cache: CacheFigures
    preemptions: int
    steps: int
    #: Simulated GPU seconds spent in steps.
    busy_s: float
    #: Where it pushes its KV events and load (``None`` until its server started).
    kv_events: KVEventsEndpoint | None = None
    #: KV event batches published since it started (never reset): a subscriber whose
    #: next expected batch is this one has every event so far.
    kv_event_batches: int = 0
    #: LoRA adapters it serves (requests name one as their ``model``), and those of them
    #: in GPU slots now, and the copies into slots so far.
    adapters: tuple[str, ...] = ()
    resident_adapters: tuple[str, ...] = ()
    adapter_loads: int = 0
    transfers: TransferFigures = TransferFigures()
    #: Its tokenizer's cache of chats' pieces, per cache salt (None: none, as for
    #: ``bytes4``).
    tokenizer_cache: TokenCacheStats | None = None


def encode(value: Any) -> dict[str, Any]:
    """A stats dataclass as JSON-ready data."""
    return dataclasses.asdict(value)


def decode(cls: type[T], data: bytes | str | dict[str, Any]) -> T:
    """``cls`` from JSON text or parsed JSON; raises ``ValueError`` naming a bad field."""
    adapter = _adapter(cls)
    if isinstance(data, dict):
        return adapter.validate_python(data)
    return adapter.validate_json(data)


def _adapter(cls: type[T]) -> TypeAdapter[T]:
    """Building a validator costs ~2 ms, using it ~4 us: one per class, kept."""
    adapter: TypeAdapter[T] | None = _ADAPTERS.get(cls)
    if adapter is None:
        adapter = _ADAPTERS[cls] = TypeAdapter(cls)
    return adapter


_ADAPTERS: dict[type, Any] = {}
