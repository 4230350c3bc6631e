"""The base of cache-aware policies: a prefix index fed by decisions and KV events."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from replica.api.kv_events import KVEvent
from router.core import Clock, ReplicaState, RoutingRequest
from router.index.prefix_index import IndexConfig, PrefixIndex
from router.policies.base import Policy

if TYPE_CHECKING:
    from router.policies.registry import PolicyConfig

log = logging.getLogger(__name__)


class IndexedPolicy(Policy):
    """A policy with a prefix index that it feeds with its decisions and KV events."""

    def __init__(self, config: PolicyConfig, clock: Clock, rng: np.random.Generator) -> None:
        super().__init__(config, clock, rng)
        self.index = PrefixIndex(self._index_config(config), config.block_size, clock, config.model)

    def _index_config(self, config: PolicyConfig) -> IndexConfig:
        return config.index

    def on_dispatch(self, request: RoutingRequest, replica: ReplicaState) -> None:
        self._know(replica)
        self._note_events(request, replica)
        self.index.record_routing(replica.replica_id, request.stride_hashes)
        self.index.request_started(replica.replica_id, request.stride_hashes)

    def _note_events(self, request: RoutingRequest, replica: ReplicaState) -> None:
        """What the replica's events alone say it holds of the prompt, and where its
        stream stands: what its answer is judged against (:meth:`_over_predicted`)."""
        held = self.index.events_held(replica.replica_id, request.stride_hashes)
        request.events_cached_tokens = None if held is None else min(held, self._limit(request))
        stream = replica.kv_stream
        request.events_batch = stream.indexed_through if stream is not None else None

    def on_complete(
        self, request: RoutingRequest, replica: ReplicaState, cached_tokens: int | None = None
    ) -> None:
        """An engine that found less cached than predicted corrects the index at once."""
        predicted = request.predicted_cached_tokens
        if cached_tokens is not None and predicted is not None and cached_tokens < predicted:
            self._over_predicted(request, replica, cached_tokens)
        self.index.request_ended(replica.replica_id, request.stride_hashes)

    def _over_predicted(self, request: RoutingRequest, replica: ReplicaState, cached: int) -> None:
        """Where the engine and the replica's events disagree (cause ``unexplained``, see
        :meth:`_over_cause`), what the index held of the prompt beyond ``cached`` is
        dropped and the stream applied again from the dispatch on
        (:meth:`PrefixIndex.disagree`), where it can be: counted apart from the answers
        where only the decisions said more, or an eviction was told
        (:meth:`PrefixIndex.correct`)."""
        index, replica_id, hashes = self.index, replica.replica_id, request.stride_hashes
        stream, batch = replica.kv_stream, request.events_batch
        request.over_cause = self._over_cause(request, replica, cached)
        if request.over_cause != "unexplained":
            replica.decision_corrections += 1
            index.correct(replica_id, hashes, cached)
            return
        replica.event_disagreements += 1
        if replica.event_disagreements == 1:  # counted after: not a line each time
            log.warning(
                "replica %s found %d cached tokens of a prompt its KV events said it held "
                "%d of, with no eviction told: its events were withheld or lost (counted "
                "in /stats as event_disagreements; with a replay socket, the prompt's "
                "entries are dropped and its stream applied again from the dispatch)",
                replica_id,
                cached,
                request.events_cached_tokens,
            )
        if stream is None or batch is None:  # nothing to apply again: keep what they said
            index.correct(replica_id, hashes, cached)
            return
        index.disagree(replica_id, hashes, cached)
        stream.replay_since(batch)

    def _over_cause(self, request: RoutingRequest, replica: ReplicaState, cached: int) -> str:
        """Why the engine found ``cached`` tokens, fewer than predicted (router/core.py,
        OVER_CAUSES): no fewer than the replica's events alone said at the dispatch
        (``pending``); fewer, with an eviction of the prompt told since (``evicted``: it
        waited in the engine's queue and lost them); fewer, none told (``unexplained``)."""
        shown = request.events_cached_tokens
        if shown is None or cached >= shown:
            return "pending"
        stride = self.index.stride_tokens
        missed = request.stride_hashes[cached // stride : shown // stride]
        evicted = self.index.evicted_in_flight(replica.replica_id, missed)
        return "evicted" if evicted else "unexplained"

    def on_replica_added(self, replica: ReplicaState) -> None:
        capacity = self._index_capacity(replica)
        self.index.add_replica(replica.replica_id, capacity, approximate=not replica.precise)

    def on_replica_removed(self, replica: ReplicaState) -> None:
        self.index.remove_replica(replica.replica_id)

    def on_kv_events(self, replica: ReplicaState, events: Sequence[KVEvent]) -> int:
        return self.index.apply_events(replica.replica_id, events)

    def _index_capacity(self, replica: ReplicaState) -> int:
        return replica.capacity_blocks

    def _know(self, replica: ReplicaState) -> None:
        """Replicas may reach the policy before ``on_replica_added`` does."""
        if not self.index.knows(replica.replica_id):
            self.on_replica_added(replica)

    def holders(self, request: RoutingRequest) -> dict[str, int]:
        return self._matches(request, ())

    def prefix_index(self) -> PrefixIndex:
        return self.index

    def cache_value(self, replica_id: str) -> float:
        """The stride keys it alone holds."""
        return float(len(self.index.exclusive_keys(replica_id)))

    def _matches(self, request: RoutingRequest, replicas: Sequence[ReplicaState]) -> dict[str, int]:
        """Cached tokens of the replicas that hold any (absent: none)."""
        matched = self.index.match(request.stride_hashes)
        limit = self._limit(request)
        return {replica: min(tokens, limit) for replica, tokens in matched.items()}

    def _host_matches(self, request: RoutingRequest, gpu: dict[str, int]) -> dict[str, int]:
        """Tokens each replica holds in its host tier beyond its ``gpu`` ones."""
        extra = self.index.match_host(request.stride_hashes, gpu)
        limit = self._limit(request)
        held = {r: min(tokens, limit - gpu.get(r, 0)) for r, tokens in extra.items()}
        return {r: tokens for r, tokens in held.items() if tokens > 0}

    def _limit(self, request: RoutingRequest) -> int:
        """The engine always computes at least the last prompt token."""
        block = self.config.block_size
        return (request.num_prompt_tokens - 1) // block * block
