"""``cache_aware_replicated``: hot prefixes spread on purpose, over a replication set.

``cache_aware`` copies a popular prefix to another replica when the replicas holding it
are loaded enough that a copy is cheaper than their queue: the spread follows the load,
one request at a time. Here each hot prefix has an explicit replication set (Preble,
ICLR 2025, replicates hot prefixes in research; no router ships it): the prefix's
share of the recent requests, times the fleet's size, is how many replicas' worth of
traffic it brings, so its set has that many replicas (``replication_headroom`` times
it, rounded up). The set's members are priced as holding the prefix (the first request
to a new member computes it, once), so its requests spread over them by load; when its
share falls the set shrinks (with a margin, so it does not flap). Members are the
first by rendezvous hashing of the prefix over the fleet: every gateway that sees the
same share picks the same replicas, with nothing shared between them, and a replica
leaving or joining moves only its own places in the sets.

A prefix is the popular part of a prompt (``PolicyConfig.popular_requests``: the
strides that many recent requests shared), named by the key of its last stride.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from router.core import Clock, ReplicaState, RoutingRequest
from router.policies.base import HotSet
from router.policies.baselines import rendezvous_order
from router.policies.cache_aware import CacheAware

#: A set shrinks only once the prefix's replicas' worth of traffic is this far below
#: its size less one (a set of k replicas holds for shares down to (k - 1.5) / n).
SHRINK_MARGIN = 0.5

if TYPE_CHECKING:
    from router.policies.registry import PolicyConfig


@dataclass(frozen=True)
class ReplicationConfig:
    """``cache_aware_replicated``'s knobs: a hot prefix's share of requests is counted
    over ``replication_half_life_s``; its replication set has ``replication_headroom``
    times the replicas' worth of traffic it brings."""

    replication_half_life_s: float = 30.0
    replication_headroom: float = 1.0

    def __post_init__(self) -> None:
        if self.replication_half_life_s <= 0 or self.replication_headroom <= 0:
            raise ValueError("replication_half_life_s and replication_headroom must be positive")


class HotSets:
    """Recent requests per hot prefix, as a share of all, and each one's set size.

    Counts decay with ``half_life_s`` of ``clock`` time; a prefix whose count decays
    below one request is forgotten at the next sweep (every ``half_life_s``), so the
    table holds the prefixes of the last few half-lives only.
    """

    def __init__(self, clock: Clock, half_life_s: float, headroom: float) -> None:
        self.clock, self.half_life_s, self.headroom = clock, half_life_s, headroom
        self._counts: dict[int, tuple[float, float]] = {}  # key -> count, when
        self._total = (0.0, 0.0)
        self._sizes: dict[int, int] = {}
        self._swept = 0.0
        #: (time, prefix key, set size) at every change of a set's size.
        self.changes: list[tuple[float, int, int]] = []

    def record(self, key: int | None) -> None:
        """One request routed, through the hot prefix ``key`` (``None``: none)."""
        now = self.clock()
        self._total = (self._decayed(self._total, now) + 1, now)
        if key is not None:
            self._counts[key] = (self._decayed(self._counts.get(key, (0.0, now)), now) + 1, now)
        if now - self._swept >= self.half_life_s:
            self._sweep(now)

    def share(self, key: int) -> float:
        now = self.clock()
        total = self._decayed(self._total, now)
        return (
            self._decayed(self._counts[key], now) / total if key in self._counts and total else 0.0
        )

    def size(self, key: int, fleet: int) -> int:
        """How many replicas the prefix should be on now (1: it is not hot)."""
        worth = self.share(key) * fleet * self.headroom  # replicas' worth of its traffic
        size = self._sizes.get(key, 1)
        if math.ceil(worth) > size or worth <= size - 1 - SHRINK_MARGIN:
            size = max(1, min(fleet, math.ceil(worth)))
        if size != self._sizes.get(key, 1):
            self.changes.append((self.clock(), key, size))
            self._sizes[key] = size
        return size

    def sizes(self) -> dict[int, int]:
        """The prefixes on more than one replica, and their set sizes."""
        return {key: size for key, size in self._sizes.items() if size > 1}

    def _decayed(self, value: tuple[float, float], now: float) -> float:
        count, when = value
        return count * math.exp2((when - now) / self.half_life_s) if count else 0.0

    def _sweep(self, now: float) -> None:
        self._swept = now
        self._counts = {k: v for k, v in self._counts.items() if self._decayed(v, now) >= 1}
        for key in list(self._sizes):
            if key not in self._counts:
                del self._sizes[key]
                self.changes.append((now, key, 1))


class CacheAwareReplicated(CacheAware):
    """``cache_aware`` with a replication set per hot prefix (see the module's doc)."""

    name = "cache_aware_replicated"

    def __init__(self, config: PolicyConfig, clock: Clock, rng: np.random.Generator) -> None:
        super().__init__(config, clock, rng)
        self.hot = HotSets(
            clock,
            config.replication.replication_half_life_s,
            config.replication.replication_headroom,
        )
        self._orders: dict[int, tuple[int, list[ReplicaState]]] = {}  # key -> fleet, order
        self._fleet_version = 0
        #: The request last priced and its hot prefix's key: its dispatch comes next,
        #: and counts it without searching its popular part again.
        self._priced: tuple[RoutingRequest, int | None] | None = None

    def hot_key(self, stride_hashes: Sequence[int]) -> int | None:
        """The key of the popular part of a prompt (``None``: no part is popular)."""
        depth = self._popular_depth(stride_hashes)
        return stride_hashes[depth - 1] if depth else None

    def _popular_depth(self, stride_hashes: Sequence[int]) -> int:
        return self.popularity.depth(stride_hashes, self.config.cache_aware.popular_requests)

    def replication_set(self, key: int) -> list[ReplicaState]:
        """The replicas a hot prefix is on now, its set's size brought up to date
        (none when it is not hot)."""
        if self.hot.size(key, len(self.order.states)) < 2:
            self._orders.pop(key, None)
            return []
        return self.members(key)

    def members(self, key: int) -> list[ReplicaState]:
        """The replicas of a prefix's set as it stands (none: not hot); no update."""
        size = self.hot.sizes().get(key, 1)
        if size < 2:
            return []
        cached = self._orders.get(key)
        if cached is None or cached[0] != self._fleet_version:
            order = rendezvous_order(key.to_bytes(8, "little"), list(self.order.states.values()))
            cached = self._orders[key] = (self._fleet_version, order)
        return cached[1][:size]

    def spread_over(self, stride_hashes: Sequence[int]) -> list[str]:
        key = self.hot_key(stride_hashes)
        return [r.replica_id for r in self.members(key)] if key is not None else []

    def hot_set_changes(self) -> list[tuple[float, int, int]]:
        return self.hot.changes

    def hot_sets(self) -> list[HotSet]:
        """Every prefix on more than one replica, largest share first."""
        sets = [
            HotSet(key, self.hot.share(key), tuple(r.replica_id for r in self.members(key)))
            for key in self.hot.sizes()
        ]
        return sorted(sets, key=lambda s: -s.share)

    def _with_session(
        self, request: RoutingRequest, replicas: Sequence[ReplicaState], matched: dict[str, int]
    ) -> dict[str, int]:
        """The matches, with a hot prefix's set priced as holding it."""
        matched = super()._with_session(request, replicas, matched)
        hashes = request.stride_hashes
        depth = self._popular_depth(hashes)
        key = hashes[depth - 1] if depth else None
        self._priced = (request, key)
        members = self.replication_set(key) if key is not None else []
        if not members:
            return matched
        stride = self.config.block_size * self.config.index.stride
        popular = min(depth * stride, request.num_prompt_tokens)  # as popular_tokens says
        held = dict(matched)
        for member in members:
            held[member.replica_id] = max(held.get(member.replica_id, 0), popular)
        return held

    def on_dispatch(self, request: RoutingRequest, replica: ReplicaState) -> None:
        priced = self._priced
        key = priced[1] if priced and priced[0] is request else self.hot_key(request.stride_hashes)
        self._priced = None
        self.hot.record(key)
        super().on_dispatch(request, replica)

    def on_replica_added(self, replica: ReplicaState) -> None:
        super().on_replica_added(replica)
        self._fleet_version += 1

    def on_replica_removed(self, replica: ReplicaState) -> None:
        super().on_replica_removed(replica)
        self._fleet_version += 1
