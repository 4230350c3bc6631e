"""What every policy shares: the replicas' state, the request as routed, the knobs.

A policy is a small class: ``choose(request, replicas)`` returns one of the
replicas; ``on_dispatch`` and ``on_complete`` keep its state. The router counts each
replica's load (see ``router/fleet/load.py``); cache-aware policies also set the request's
predicted cached tokens, so prediction accuracy can be measured. The clock and the
random generator are passed in, never global.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import ClassVar

import numpy as np

from replica.api.cost_model import get_profile
from replica.api.identity import DEFAULT_BLOCK_SIZE, DEFAULT_MODEL
from replica.api.kv_events import KVEvent
from router.core import Clock, ReplicaState, RoutingRequest
from router.index.prefix_index import IndexConfig, PrefixIndex


@dataclass(frozen=True)
class PolicyConfig:
    """Knobs of every policy; each reads the ones it needs."""

    #: Tokens per KV block of the fleet's engines (the router must hash as they do).
    block_size: int = DEFAULT_BLOCK_SIZE
    #: The model the fleet serves: it seeds the router's keys, as it seeds the engines'
    #: identities. Set by the config that embeds this one (the gateway's, the replay's).
    model: str = field(default=DEFAULT_MODEL, metadata={"flag": False})
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
    #: cache_aware_replicated: a hot prefix's share of requests is counted over this
    #: half-life; its replication set has ``replication_headroom`` times the replicas'
    #: worth of traffic it brings (router/policies/replicated.py).
    replication_half_life_s: float = 30.0
    replication_headroom: float = 1.0
    #: cache_aware: what a token held in a replica's host tier costs, in prefill tokens:
    #: loading its KV over PCIe against computing it. Llama-3-8B moves 128 KiB a token,
    #: 2.6 us at 50 GB/s (PCIe 5) against 23 us of prefill on an H100 (0.11), 5.2 us at
    #: 25 GB/s (PCIe 4) against 74 us on an A100 (0.07): see replica/api/cost_model.py.
    host_token_cost: float = 0.1
    #: cache_aware: a cold prefix may go to any replica within this much work of the
    #: least loaded; among them the rendezvous choice wins, so routers agree.
    cold_slack_tokens: float = 512.0
    #: cache_aware: bounded loads, made soft: a replica holding more than ``load_bound``
    #: times the fleet's mean outstanding requests weighs ``overflow_tokens`` more per
    #: request beyond it. A short prefix moves away; a long private history may stay.
    load_bound: float = 1.5
    overflow_tokens: float = 2048.0
    #: cache_aware: what running a request's LoRA adapter costs where no GPU slot holds
    #: it, in prefill tokens, where the replica says its slots: a copy into a free slot
    #: (1.7 ms for rank 16 on Llama-3-8B over PCIe 5, about 75 tokens of an H100's
    #: prefill), or, with every slot's adapter running, a wait until one's requests have
    #: all finished: a few hundred decode steps, seconds (2.5 s is 100k tokens of an
    #: H100's prefill), which outweighs moving any history. On the mixed workload of
    #: docs/results.md, 8k, 32k and 128k gave its adapters a TTFT p99 of 5.9, 4.0, 2.5 s.
    adapter_load_tokens: float = 128.0
    adapter_wait_tokens: float = 131072.0
    #: cache_aware_ttft: the cost profile its seconds come from, a built-in name or a
    #: calibrated profile file (``prefix-router calibrate``); empty: the engines' (the
    #: replayer's ``--profile``; a gateway's: the simulated replica's default).
    cost_profile: str = ""
    #: cache_aware_ttft: prefill tokens an engine computes per step (vLLM's
    #: ``max_num_batched_tokens``): a queue of them takes that many steps, each
    #: carrying the replica's running sequences. 0: the engines' (the replayer's
    #: ``--max-num-batched-tokens``; a gateway's: the simulated replica's, 8,192).
    step_token_budget: int = 0
    #: sglang_cache_aware: SGLang router's defaults.
    cache_threshold: float = 0.3
    balance_abs_threshold: int = 64
    balance_rel_threshold: float = 1.5
    #: SGLang's tree holds up to 2**26 characters per worker (about 4 per token).
    sglang_max_tree_tokens: int = 2**26 // 4

    def for_engines(self, profile: str, step_token_budget: int) -> PolicyConfig:
        """These knobs with the seconds priced as the fleet's engines run, unless set."""
        return replace(
            self,
            cost_profile=self.cost_profile or profile,
            step_token_budget=self.step_token_budget or step_token_budget,
        )

    @property
    def stride_tokens(self) -> int:
        """Tokens between two hashed block boundaries (the router's unit of prefix)."""
        return self.block_size * self.index.stride

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be positive, got {self.block_size}")
        if not 0 <= self.cache_threshold <= 1:
            raise ValueError("cache_threshold must lie in [0, 1]")
        if self.running_request_tokens < 0 or self.cold_slack_tokens < 0:
            raise ValueError("running_request_tokens and cold_slack_tokens must not be negative")
        if self.host_token_cost < 0:
            raise ValueError("host_token_cost must not be negative")
        if self.recompute_weight <= 0 or self.private_recompute_weight <= 0:
            raise ValueError("recompute_weight and private_recompute_weight must be positive")
        if self.step_token_budget < 0:
            raise ValueError(
                f"step_token_budget must not be negative, got {self.step_token_budget}"
            )
        if self.cost_profile:
            try:
                get_profile(self.cost_profile)  # read once here, so a bad one fails at start
            except ValueError as error:
                raise ValueError(f"--cost-profile: {error}") from None
        if self.replication_half_life_s <= 0 or self.replication_headroom <= 0:
            raise ValueError("replication_half_life_s and replication_headroom must be positive")
        if self.load_bound < 1 or self.overflow_tokens < 0 or self.popular_requests < 1:
            raise ValueError("load_bound must be at least 1, overflow_tokens not negative "
                             "and popular_requests positive")  # fmt: skip


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

    def __init__(self, config: PolicyConfig, clock: Clock, rng: np.random.Generator) -> None:
        self.config = config
        self.clock = clock
        self.rng = rng

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
        return replicas[int(self.rng.integers(len(replicas)))] if len(replicas) > 1 else replicas[0]
