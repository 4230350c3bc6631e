"""``cache_aware``: least total work, the prefill a replica would do plus its queue."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import ClassVar

import numpy as np

from router.policies.base import Clock, PolicyConfig, ReplicaState, RoutingRequest
from router.policies.baselines import rendezvous, rendezvous_key
from router.policies.indexed import IndexedPolicy
from router.prefix_index import IndexConfig, PrefixPopularity


class CacheAware(IndexedPolicy):
    """Least total work: the prefill a replica would do plus the work queued on it.

    cost(replica) = recompute_weight x uncached tokens of a popular prefix there
                  + private_recompute_weight x the request's other uncached tokens
                  + host_token_cost x tokens it holds in its host tier only
                  + its outstanding prefill tokens
                  + running_request_tokens x its outstanding requests
                  + overflow_tokens x its outstanding requests beyond the load bound

    all in prefill tokens. Lowest cost wins, ties at random. A popular prefix (a
    system prompt many sessions share) is cheap to copy to a less loaded replica, so
    new sessions spread; a conversation's own history is dear to move, so its next
    turn stays where it is cached. The load bound, ``load_bound`` (1.5) times the
    fleet's mean outstanding requests (consistent hashing with bounded loads,
    Mirrokni et al. 2018, made soft), keeps a lightly loaded fleet even, where the
    queue terms hardly weigh.

    A hot shared prompt cached on one replica is copied to another as soon as the
    first replica's queue outweighs the copy, so it never stays pinned while others
    idle; each request weighs its own cached tokens, so affinity is never dropped for
    all requests at once (SGLang's fleet-wide imbalance switch does that). A prefix
    cached nowhere goes to the rendezvous choice among the near-least-loaded
    replicas, so independent routers send the same new prefix to the same place.

    A token held in a replica's host tier (learned from its KV events) costs its load
    over PCIe, a tenth of computing it by default: a GPU hit is preferred to a host
    hit, and a host hit to a miss.
    """

    name = "cache_aware"
    #: Whether tokens in a replica's host tier count as held (the tier-blind variant
    #: counts them as misses, as a router that follows only GPU evictions would).
    tier_aware: ClassVar[bool] = True

    def __init__(self, config: PolicyConfig, clock: Clock, rng: np.random.Generator) -> None:
        super().__init__(config, clock, rng)
        self.popularity = PrefixPopularity()

    def choose(self, request: RoutingRequest, replicas: Sequence[ReplicaState]) -> ReplicaState:
        matched = self._matches(request, replicas)
        host = self._host_matches(request, matched) if self.tier_aware else {}
        popular = self._popular_tokens(request)
        loads = self._loads(replicas)
        if not host and not any(matched.values()):
            request.predicted_cached_tokens = 0
            ceiling = min(loads) + self.config.cold_slack_tokens
            near = [r for r, load in zip(replicas, loads, strict=True) if load <= ceiling]
            return rendezvous(rendezvous_key(request), near)
        prompt = request.num_prompt_tokens
        nothing_cached = self._recompute_cost(prompt, popular, 0)  # most replicas, often
        costs = [
            load
            + (
                self._held_cost(
                    prompt, popular, matched.get(r.replica_id, 0), host.get(r.replica_id, 0)
                )
                if r.replica_id in matched or r.replica_id in host
                else nothing_cached
            )
            for r, load in zip(replicas, loads, strict=True)
        ]
        best = min(costs)
        chosen = self._pick([r for r, cost in zip(replicas, costs, strict=True) if cost == best])
        held = matched.get(chosen.replica_id, 0) + host.get(chosen.replica_id, 0)
        request.predicted_cached_tokens = held  # the engine reports host hits as cached
        return chosen

    def _held_cost(self, prompt: int, popular: int, gpu: int, host: int) -> float:
        """The work of a replica holding ``gpu`` leading tokens, then ``host`` more."""
        loading = self.config.host_token_cost * host if host else 0.0
        return self._recompute_cost(prompt, popular, gpu + host) + loading

    def on_dispatch(self, request: RoutingRequest, replica: ReplicaState) -> None:
        super().on_dispatch(request, replica)
        self.popularity.record(request.stride_hashes)

    def _popular_tokens(self, request: RoutingRequest) -> int:
        """Leading tokens of the request that many recent requests shared."""
        config = self.config
        depth = self.popularity.depth(request.stride_hashes, config.popular_requests)
        return min(depth * config.block_size * config.index.stride, request.num_prompt_tokens)

    def _recompute_cost(self, prompt: int, popular: int, cached: int) -> float:
        """Uncached tokens, those of the popular prefix and the request's own apart."""
        shared = max(0, popular - cached)
        own = prompt - max(popular, cached)
        return self.config.recompute_weight * shared + self.config.private_recompute_weight * own

    def _loads(self, replicas: Sequence[ReplicaState]) -> list[float]:
        config = self.config
        mean = (sum(r.load_requests for r in replicas) + 1) / len(replicas)
        cap = config.load_bound * mean  # the mean counts this request
        per_request, overflow = config.running_request_tokens, config.overflow_tokens
        loads = []
        for replica in replicas:
            held = replica.load_requests
            excess = held + 1 - cap
            queued = replica.load_prefill_tokens + per_request * held
            loads.append(queued + overflow * excess if excess > 0 else queued)
        return loads


class CacheAwareTierBlind(CacheAware):
    """``cache_aware`` that counts a replica's host-tier tokens as misses: the baseline
    that shows what knowing the tiers buys."""

    name = "cache_aware_tier_blind"
    tier_aware = False


class CacheAwareApproximate(CacheAware):
    """``cache_aware`` with an index that learns only from its own routing decisions."""

    name = "cache_aware_approx"

    def _index_config(self, config: PolicyConfig) -> IndexConfig:
        return replace(config.index, mode="approximate")
