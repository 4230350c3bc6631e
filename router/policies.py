"""Routing policies, chosen by name from a registry.

A policy is a small class: ``choose(request, replicas)`` returns one of the
replicas; ``on_dispatch`` and ``on_complete`` keep its state. The router counts each
replica's load at dispatch and releases it on completion, error or abort (see
:class:`ReplicaState`); cache-aware policies also set the request's predicted cached
tokens, so prediction accuracy can be measured. The clock and the random generator
are passed in, never global.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import ClassVar

import numpy as np
import xxhash

from router.prefix_index import IndexConfig, PrefixIndex, PrefixPopularity

Clock = Callable[[], float]


@dataclass(eq=False)
class ReplicaState:
    """What the router knows of one replica.

    ``outstanding_prefill_tokens`` counts the tokens its dispatched requests still have
    to prefill (their predicted uncached part), until their first token arrives.
    """

    replica_id: str
    capacity_blocks: int = 0
    outstanding_requests: int = 0
    outstanding_prefill_tokens: int = 0
    dispatched: int = 0


@dataclass(eq=False)
class RoutingRequest:
    """A request as the router sees it: its length and its leading block identities.

    ``stride_hashes`` are the identities at every ``stride``-th block boundary.
    ``predicted_cached_tokens`` is set by a cache-aware policy's ``choose``.
    """

    request_id: str
    num_prompt_tokens: int
    stride_hashes: Sequence[int] = field(default=(), repr=False)
    predicted_cached_tokens: int | None = None
    #: Who sent it (``None`` without API keys); its identities are seeded per tenant.
    tenant: str | None = None

    @property
    def predicted_uncached_tokens(self) -> int:
        return self.num_prompt_tokens - (self.predicted_cached_tokens or 0)


@dataclass(frozen=True)
class PolicyConfig:
    """Knobs of every policy; each reads the ones it needs."""

    block_size: int = 16
    index: IndexConfig = field(default_factory=IndexConfig)
    #: cache_aware: prefill tokens one running request weighs, to put queued prefill
    #: and running sequences in one unit (its decode steps slow the replica's batch).
    running_request_tokens: float = 256.0
    #: cache_aware: what an uncached prompt token costs, relative to a queued one. A
    #: queued token delays only this request; a token computed again is GPU work that
    #: every request queued after it waits for. A token of a popular prefix (shared by
    #: many recent requests, like a system prompt) weighs ``recompute_weight``: copying
    #: it to another replica is paid once and serves every later request there. A token
    #: of the conversation's own history weighs ``private_recompute_weight``: moving it
    #: is paid again on every move, and leaves a stale copy behind.
    recompute_weight: float = 4.0
    private_recompute_weight: float = 16.0
    #: cache_aware: a prefix is popular once this many recent requests passed through
    #: it (more than the turns of most conversations).
    popular_requests: int = 16
    #: cache_aware: a cold prefix may go to any replica within this much work of the
    #: least loaded; among them the rendezvous choice wins, so routers agree.
    cold_slack_tokens: float = 512.0
    #: cache_aware: bounded loads, made soft: a replica holding more than ``load_bound``
    #: times the fleet's mean outstanding requests weighs ``overflow_tokens`` more per
    #: request beyond it. A short prefix moves away; a long private history may stay.
    load_bound: float = 1.5
    overflow_tokens: float = 2048.0
    #: sglang_cache_aware: SGLang router's defaults.
    cache_threshold: float = 0.3
    balance_abs_threshold: int = 64
    balance_rel_threshold: float = 1.5
    #: SGLang's tree holds up to 2**26 characters per worker (about 4 per token).
    sglang_max_tree_tokens: int = 2**26 // 4

    def __post_init__(self) -> None:
        if not 0 <= self.cache_threshold <= 1:
            raise ValueError("cache_threshold must lie in [0, 1]")
        if self.running_request_tokens < 0 or self.cold_slack_tokens < 0:
            raise ValueError("running_request_tokens and cold_slack_tokens must not be negative")
        if self.recompute_weight <= 0 or self.private_recompute_weight <= 0:
            raise ValueError("recompute_weight and private_recompute_weight must be positive")
        if self.load_bound < 1 or self.overflow_tokens < 0 or self.popular_requests < 1:
            raise ValueError("load_bound must be at least 1, overflow_tokens not negative "
                             "and popular_requests positive")  # fmt: skip


class Policy:
    """Base class: subclasses set ``name`` and implement ``choose``."""

    name: ClassVar[str] = ""

    def __init__(self, config: PolicyConfig, clock: Clock, rng: np.random.Generator) -> None:
        self.config = config
        self.clock = clock
        self.rng = rng

    def choose(self, request: RoutingRequest, replicas: Sequence[ReplicaState]) -> ReplicaState:
        raise NotImplementedError

    def on_dispatch(self, request: RoutingRequest, replica: ReplicaState) -> None:
        """Called once the request is sent to ``replica``."""

    def on_complete(self, request: RoutingRequest, replica: ReplicaState) -> None:
        """Called when the request ends, whether it finished, failed or was aborted."""

    def on_replica_added(self, replica: ReplicaState) -> None:
        """Called when a replica joins the fleet."""

    def on_replica_removed(self, replica: ReplicaState) -> None:
        """Called when a replica leaves: forget everything about it."""

    def on_kv_events(self, replica: ReplicaState, events: Sequence[object]) -> None:
        """Called with a replica's KV events (precise cache-aware routing uses them)."""

    def _least_loaded(self, replicas: Sequence[ReplicaState]) -> ReplicaState:
        low = min(r.outstanding_requests for r in replicas)
        return self._pick([r for r in replicas if r.outstanding_requests == low])

    def _pick(self, replicas: Sequence[ReplicaState]) -> ReplicaState:
        return replicas[int(self.rng.integers(len(replicas)))] if len(replicas) > 1 else replicas[0]


# ------------------------------------------------------------------ baselines


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

    def choose(self, request: RoutingRequest, replicas: Sequence[ReplicaState]) -> ReplicaState:
        if len(replicas) < 3:
            return self._least_loaded(replicas)
        first, second = self.rng.choice(len(replicas), 2, replace=False)
        return self._least_loaded([replicas[int(first)], replicas[int(second)]])


def rendezvous_key(request: RoutingRequest) -> bytes:
    """What rendezvous hashing hashes: the first block's identity, else the request id."""
    if request.stride_hashes:
        return request.stride_hashes[0].to_bytes(8, "little")
    return request.request_id.encode()


def rendezvous(key: bytes, replicas: Sequence[ReplicaState]) -> ReplicaState:
    """Highest random weight: every router picks the same replica for the same key,
    and removing a replica moves only the keys it held."""
    return max(replicas, key=lambda r: xxhash.xxh3_64_intdigest(key + r.replica_id.encode()))


class ConsistentHash(Policy):
    """Rendezvous hashing on the first block: sticky, stateless, blind to load."""

    name = "consistent_hash"

    def choose(self, request: RoutingRequest, replicas: Sequence[ReplicaState]) -> ReplicaState:
        return rendezvous(rendezvous_key(request), replicas)


# --------------------------------------------------------------- cache-aware


class _Indexed(Policy):
    """A policy with a prefix index that it feeds with its decisions and KV events."""

    def __init__(self, config: PolicyConfig, clock: Clock, rng: np.random.Generator) -> None:
        super().__init__(config, clock, rng)
        self.index = PrefixIndex(self._index_config(config), config.block_size, clock)

    def _index_config(self, config: PolicyConfig) -> IndexConfig:
        return config.index

    def on_dispatch(self, request: RoutingRequest, replica: ReplicaState) -> None:
        self._know(replica)
        self.index.record_routing(replica.replica_id, request.stride_hashes)

    def on_replica_added(self, replica: ReplicaState) -> None:
        self.index.add_replica(replica.replica_id, self._index_capacity(replica))

    def on_replica_removed(self, replica: ReplicaState) -> None:
        self.index.remove_replica(replica.replica_id)

    def on_kv_events(self, replica: ReplicaState, events: Sequence[object]) -> None:
        self.index.apply_events(replica.replica_id, events)  # type: ignore[arg-type]

    def _index_capacity(self, replica: ReplicaState) -> int:
        return replica.capacity_blocks

    def _know(self, replica: ReplicaState) -> None:
        """Replicas may reach the policy before ``on_replica_added`` does."""
        if not self.index.knows(replica.replica_id):
            self.on_replica_added(replica)

    def _matches(self, request: RoutingRequest, replicas: Sequence[ReplicaState]) -> dict[str, int]:
        """Cached tokens of the replicas that hold any (absent: none)."""
        matched = self.index.match(request.stride_hashes)
        # The engine always computes at least the last prompt token.
        limit = (request.num_prompt_tokens - 1) // self.config.block_size * self.config.block_size
        return {replica: min(tokens, limit) for replica, tokens in matched.items()}


class CacheAware(_Indexed):
    """Least total work: the prefill a replica would do plus the work queued on it.

    cost(replica) = recompute_weight x uncached tokens of a popular prefix there
                  + private_recompute_weight x the request's other uncached tokens
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
    """

    name = "cache_aware"

    def __init__(self, config: PolicyConfig, clock: Clock, rng: np.random.Generator) -> None:
        super().__init__(config, clock, rng)
        self.popularity = PrefixPopularity()

    def choose(self, request: RoutingRequest, replicas: Sequence[ReplicaState]) -> ReplicaState:
        matched = self._matches(request, replicas)
        popular = self._popular_tokens(request)
        loads = self._loads(replicas)
        if not any(matched.values()):
            request.predicted_cached_tokens = 0
            ceiling = min(loads) + self.config.cold_slack_tokens
            near = [r for r, load in zip(replicas, loads, strict=True) if load <= ceiling]
            return rendezvous(rendezvous_key(request), near)
        prompt = request.num_prompt_tokens
        nothing_cached = self._recompute_cost(prompt, popular, 0)  # most replicas, often
        costs = [
            load
            + (
                self._recompute_cost(prompt, popular, matched[r.replica_id])
                if r.replica_id in matched
                else nothing_cached
            )
            for r, load in zip(replicas, loads, strict=True)
        ]
        best = min(costs)
        chosen = self._pick([r for r, cost in zip(replicas, costs, strict=True) if cost == best])
        request.predicted_cached_tokens = matched.get(chosen.replica_id, 0)
        return chosen

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
        mean = (sum(r.outstanding_requests for r in replicas) + 1) / len(replicas)
        cap = config.load_bound * mean  # the mean counts this request
        per_request, overflow = config.running_request_tokens, config.overflow_tokens
        loads = []
        for replica in replicas:
            held = replica.outstanding_requests
            excess = held + 1 - cap
            queued = replica.outstanding_prefill_tokens + per_request * held
            loads.append(queued + overflow * excess if excess > 0 else queued)
        return loads


class CacheAwareApproximate(CacheAware):
    """``cache_aware`` with an index that learns only from its own routing decisions."""

    name = "cache_aware_approx"

    def _index_config(self, config: PolicyConfig) -> IndexConfig:
        return replace(config.index, mode="approximate")


class SGLangCacheAware(_Indexed):
    """SGLang router's ``cache_aware``, re-implemented from its documented algorithm.

    1. If the fleet is imbalanced, (max - min) > balance_abs_threshold and
       max > balance_rel_threshold x min in outstanding requests, go to the least
       loaded worker.
    2. Else find the worker whose approximate tree matches the longest prefix; if the
       match rate (matched / prompt tokens) exceeds cache_threshold, go there.
    3. Else go to the worker with the smallest tree (the most free cache, it assumes).
    Every decision inserts the prompt into the chosen worker's tree; the tree learns
    only from routing and holds up to 2**26 characters per worker, so it rarely
    forgets what a worker has long evicted.
    """

    name = "sglang_cache_aware"

    def _index_config(self, config: PolicyConfig) -> IndexConfig:
        return replace(config.index, mode="approximate", ttl_s=float("inf"))

    def choose(self, request: RoutingRequest, replicas: Sequence[ReplicaState]) -> ReplicaState:
        matched = self._matches(request, replicas)
        loads = [r.outstanding_requests for r in replicas]
        high, low = max(loads), min(loads)
        config = self.config
        if high - low > config.balance_abs_threshold and high > config.balance_rel_threshold * low:
            chosen = self._least_loaded(replicas)
        else:
            best = max(replicas, key=lambda r: matched.get(r.replica_id, 0))
            rate = matched.get(best.replica_id, 0) / request.num_prompt_tokens
            if rate > config.cache_threshold:
                chosen = best
            else:
                chosen = min(replicas, key=lambda r: self.index.num_entries(r.replica_id))
        request.predicted_cached_tokens = matched.get(chosen.replica_id, 0)
        return chosen

    def _index_capacity(self, replica: ReplicaState) -> int:
        return self.config.sglang_max_tree_tokens // self.config.block_size


POLICIES: dict[str, type[Policy]] = {
    cls.name: cls
    for cls in (
        RoundRobin,
        Random,
        LeastLoaded,
        PowerOfTwo,
        ConsistentHash,
        SGLangCacheAware,
        CacheAware,
        CacheAwareApproximate,
    )
}


def make_policy(
    name: str,
    clock: Clock,
    rng: np.random.Generator,
    config: PolicyConfig | None = None,
) -> Policy:
    try:
        cls = POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; known: {', '.join(POLICIES)}") from None
    return cls(config or PolicyConfig(), clock, rng)
