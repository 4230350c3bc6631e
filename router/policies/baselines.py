"""Policies blind to the cache: the baselines a cache-aware policy must beat."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import xxhash

from router.core import Clock, ReplicaState, RoutingRequest
from router.policies.base import Policy
from router.policies.ties import NumpyTies

if TYPE_CHECKING:
    from router.policies.registry import PolicyConfig


class RoundRobin(Policy):
    """Each replica in turn, blind to cache and load: the baseline to beat."""

    name = "round_robin"

    def __init__(self, config: PolicyConfig, clock: Clock, rng: np.random.Generator) -> None:
        super().__init__(config, clock, rng)
        self._next = 0

    def choose(self, request: RoutingRequest, replicas: Sequence[ReplicaState]) -> ReplicaState:
        replica = replicas[self._next % len(replicas)]
        self._next += 1
        return replica


class Random(Policy):
    name = "random"

    def choose(self, request: RoutingRequest, replicas: Sequence[ReplicaState]) -> ReplicaState:
        return self._pick(replicas)


class LeastLoaded(Policy):
    """Fewest outstanding requests, ties at random."""

    name = "least_loaded"

    def choose(self, request: RoutingRequest, replicas: Sequence[ReplicaState]) -> ReplicaState:
        return self._least_loaded(replicas)


class PowerOfTwo(Policy):
    """Two replicas at random, the less loaded wins (as Ray Serve's default router)."""

    name = "power_of_two"

    def __init__(self, config: PolicyConfig, clock: Clock, rng: np.random.Generator) -> None:
        super().__init__(config, clock, rng)
        self.ties = NumpyTies(rng)

    def choose(self, request: RoutingRequest, replicas: Sequence[ReplicaState]) -> ReplicaState:
        if len(replicas) < 3:
            return self._least_loaded(replicas)
        first, second = self.rng.choice(len(replicas), 2, replace=False)
        return self._least_loaded([replicas[int(first)], replicas[int(second)]])


def rendezvous_key(request: RoutingRequest) -> bytes:
    """What rendezvous hashing hashes: the identity of the prompt's first stride (its
    affinity, else its first key), else the request id."""
    first = request.affinity
    if first is None and request.stride_hashes:
        first = request.stride_hashes[0]
    return request.request_id.encode() if first is None else first.to_bytes(8, "little")


def rendezvous(key: bytes, replicas: Sequence[ReplicaState]) -> ReplicaState:
    """Highest random weight: every router picks the same replica for the same key,
    and removing a replica moves only the keys it held."""
    return max(replicas, key=lambda r: rendezvous_weight(key, r))


def rendezvous_order(key: bytes, replicas: Sequence[ReplicaState]) -> list[ReplicaState]:
    """The replicas by rendezvous weight for ``key``, highest first: the first k are
    every router's k choices, and removing a replica moves only its own places."""
    return sorted(replicas, key=lambda r: rendezvous_weight(key, r), reverse=True)


def rendezvous_weight(key: bytes, replica: ReplicaState) -> int:
    return xxhash.xxh3_64_intdigest(key + replica.replica_id.encode())


class ConsistentHash(Policy):
    """Rendezvous hashing on the first block: sticky, stateless, blind to load."""

    name = "consistent_hash"

    def choose(self, request: RoutingRequest, replicas: Sequence[ReplicaState]) -> ReplicaState:
        return rendezvous(rendezvous_key(request), replicas)
