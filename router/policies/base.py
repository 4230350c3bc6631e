"""What every policy shares: the ``Policy`` base and what it can be asked.

A policy is a small class: ``choose(request, replicas)`` returns one of the
replicas; ``on_dispatch`` and ``on_complete`` keep its state. The router counts each
replica's load (see ``router/fleet/load.py``); cache-aware policies also set the request's
predicted cached tokens, so prediction accuracy can be measured. The clock and the
random generator are passed in, never global.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import numpy as np

from replica.api.kv_events import KVEvent
from router.core import Clock, ReplicaState, RoutingRequest
from router.index.prefix_index import PrefixIndex
from router.policies.ties import Ties

if TYPE_CHECKING:  # the knobs of every policy, each policy's with it
    from router.policies.registry import PolicyConfig


@dataclass(frozen=True)
class HotSet:
    """A hot prefix's replication set, for ``/stats`` and the dashboard."""

    key: int
    #: The prefix's share of recent requests, and its replicas in rendezvous order.
    share: float
    replicas: tuple[str, ...]


class Policy:
    """Base class: subclasses set ``name`` and implement ``choose``.

    What a policy can do beyond choosing is asked of it here, never found by checking
    its class: the index it keeps (:meth:`prefix_index`), the popular part of a prompt
    (:meth:`popular_tokens`), its hot prefixes' replication sets (:meth:`hot_sets`,
    :meth:`spread_over`, :meth:`hot_set_changes`), what the fleet would lose with a
    replica (:meth:`cache_value`) and who holds a prompt (:meth:`holders`). Each
    answers "nothing" by default.
    """

    name: ClassVar[str] = ""
    #: Whether it splits requests into a prefill and a decode leg (``request.kv``'s
    #: ``prefill``: router/policies/disaggregated.py), and so reads replicas' roles.
    disaggregates: ClassVar[bool] = False

    def __init__(self, config: PolicyConfig, clock: Clock, rng: np.random.Generator) -> None:
        self.config = config
        self.clock = clock
        self.rng = rng
        self.ties = Ties(rng)

    def choose(self, request: RoutingRequest, replicas: Sequence[ReplicaState]) -> ReplicaState:
        raise NotImplementedError

    def cache_value(self, replica_id: str) -> float:
        """What the fleet's caches would lose with ``replica_id`` (for a scale-in:
        router/fleet/autoscaler.py); a policy that keeps no index knows of nothing."""
        return 0.0

    def holders(self, request: RoutingRequest) -> dict[str, int]:
        """The prompt tokens each replica is predicted to hold on its GPU, by replica id
        (absent: none; a policy that keeps no index predicts none)."""
        return {}

    def prefix_index(self) -> PrefixIndex | None:
        """The index it routes by, for budgets, footprints and the dashboard (``None``:
        it keeps none)."""
        return None

    def popular_tokens(self, request: RoutingRequest) -> int:
        """Leading tokens of the request that many recent requests shared (a system
        prompt, say), as far as the policy tracks it (here: not at all)."""
        return 0

    def hot_sets(self) -> list[HotSet]:
        """The hot prefixes it spreads over several replicas, largest share first."""
        return []

    def spread_over(self, stride_hashes: Sequence[int]) -> list[str]:
        """The replicas the popular part of a prompt is spread over (none: no set)."""
        return []

    def hot_set_changes(self) -> list[tuple[float, int, int]]:
        """Every change of a set's size: (when, the prefix's key, the new size)."""
        return []

    def on_dispatch(self, request: RoutingRequest, replica: ReplicaState) -> None:
        """Called once the request is sent to ``replica``."""

    def on_complete(
        self, request: RoutingRequest, replica: ReplicaState, cached_tokens: int | None = None
    ) -> None:
        """Called when the request ends, whether it finished, failed or was aborted;
        ``cached_tokens``: the prompt tokens the engine found cached, if it said."""

    def on_replica_added(self, replica: ReplicaState) -> None:
        """Called when a replica joins the fleet."""

    def on_replica_removed(self, replica: ReplicaState) -> None:
        """Called when a replica leaves: forget everything about it."""

    def on_kv_events(self, replica: ReplicaState, events: Sequence[KVEvent]) -> int:
        """Called with a replica's KV events (precise cache-aware routing uses them);
        returns how many stored blocks it could not key (none, if it keys none)."""
        return 0

    def _least_loaded(self, replicas: Sequence[ReplicaState]) -> ReplicaState:
        low = min(r.load_requests for r in replicas)
        return self._pick([r for r in replicas if r.load_requests == low])

    def _pick(self, replicas: Sequence[ReplicaState]) -> ReplicaState:
        return replicas[self.ties.below(len(replicas))] if len(replicas) > 1 else replicas[0]
