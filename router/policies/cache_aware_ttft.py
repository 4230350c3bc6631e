"""``cache_aware_ttft``: ``cache_aware`` priced in seconds, the predicted time to the
request's first token on each replica, from the engines' cost profile."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from replica.api.config import DEFAULT_PROFILE, ReplicaConfig
from replica.api.cost_model import CostProfile, attention_pairs, get_profile
from router.core import Clock, ReplicaState, RoutingRequest
from router.policies.cache_aware import CacheAware
from router.policies.load_order import Load

#: The simulated replica's ``max_num_batched_tokens`` (vLLM's default too).
DEFAULT_STEP_TOKEN_BUDGET = ReplicaConfig.max_num_batched_tokens
#: Weight of each finished request in the running mean of requests' lifetimes.
LIFETIME_SMOOTHING = 0.05

if TYPE_CHECKING:
    from router.policies.registry import PolicyConfig


@dataclass(frozen=True)
class TTFTConfig:
    """``cache_aware_ttft``'s knobs: where its seconds come from."""

    #: The cost profile, a built-in name or a calibrated profile file (``prefix-router
    #: calibrate``); empty: the engines' (the replayer's ``--profile``; a gateway's: the
    #: simulated replica's default).
    cost_profile: str = ""
    #: Prefill tokens an engine computes per step (vLLM's ``max_num_batched_tokens``):
    #: a queue of them takes that many steps, each carrying the replica's running
    #: sequences. 0: the engines' (the replayer's ``--max-num-batched-tokens``; a
    #: gateway's: the simulated replica's, 8,192).
    step_token_budget: int = 0

    def __post_init__(self) -> None:
        if self.step_token_budget < 0:
            raise ValueError(
                f"step_token_budget must not be negative, got {self.step_token_budget}"
            )
        if self.cost_profile:
            try:
                get_profile(self.cost_profile)  # read once here, so a bad one fails at start
            except ValueError as error:
                raise ValueError(f"--cost-profile: {error}") from None


class CacheAwareTTFT(CacheAware):
    """Least predicted time to first token, with ``cache_aware``'s care for reuse.

    cost(replica) = queue(its queued prefill Q, its requests H)
                  + prefill(the request's uncached tokens after its cached ones there)
                  + load(the tokens it holds in its host tier only)
                  + admission(the KV blocks it lacks for them)
                  + reuse(the uncached tokens)
                  + overflow(its requests beyond the load bound)

    all in seconds of the profile's engine (:meth:`first_token_s` is the queue, the
    prefill and the admission of a request whose cached tokens are on the GPU).
    The queue is Q tokens of prefill computed ``step_token_budget`` at a time, each
    step (and the request's own) carrying the H running sequences: their decode token,
    LM head and per-sequence cost. The prefill is the request's own step as the
    engine times it: the linear layers per token, attention over the cached and new
    tokens (a long uncached prompt costs more than its length says), the LM head
    once, and at least the step's weight read. A host hit costs its copy over the
    profile's host link. Admission is the wait for KV blocks on a replica whose pool
    is full of running requests (its load reports say how many blocks it could give):
    they come free as those requests finish, each once a lifetime. Under load this is
    where the slowest requests wait, with no prefill queued ahead of them, and no
    token weight sees it (``cache_aware`` weighs each running request as 256 tokens
    instead); pricing it has not shortened the tail in the replays measured
    (docs/results.md, "Routing in predicted seconds").

    Reuse keeps ``cache_aware``'s judgement of what moving a prefix costs later: an
    uncached token of a popular prefix weighs ``recompute_weight - 1`` more tokens of
    prefill, one of the conversation's own history ``private_recompute_weight - 1``
    (the copy computed now is already in the prefill term). The soft load bound and
    the cold slack are ``cache_aware``'s, their tokens priced at the linear rate.

    Every replica is priced (the fleet path, which orders replicas by load alone,
    cannot see their free blocks): a decision costs O(replicas). What it does not
    see: the attention of the queued prompts (only their token count is known), the
    context of the running sequences, and prefills that arrive after the request and
    share its step. Lifetimes are measured on the clock: for engines slower than
    their profile (a replay's ``--compute-scale``, a simulated replica's speed-up)
    the wait for blocks weighs more than the profile's seconds; a calibrated profile
    has no such gap.
    """

    name = "cache_aware_ttft"
    prices_every_replica = True

    def __init__(self, config: PolicyConfig, clock: Clock, rng: np.random.Generator) -> None:
        self.profile: CostProfile = get_profile(config.ttft.cost_profile or DEFAULT_PROFILE)
        self.step_tokens = config.ttft.step_token_budget or DEFAULT_STEP_TOKEN_BUDGET
        #: Seconds from dispatch to completion, as a running mean over the fleet.
        self.lifetime_s: float | None = None
        self._dispatched_at: dict[str, float] = {}
        super().__init__(config, clock, rng)

    def first_token_s(self, replica: ReplicaState, cached: int, uncached: int) -> float:
        """Predicted seconds to the first token of a request with ``cached`` tokens
        held on ``replica``'s GPU and ``uncached`` to compute there."""
        return (
            self._queue_s(replica.load_prefill_tokens, replica.load_requests)
            + self._prefill_s(cached, uncached)
            + self._unseen_by_load(replica, uncached)
        )

    @property
    def _token_s(self) -> float:
        """A prefill token's linear cost: the unit the token knobs are priced in."""
        return self.profile.costs.token_s

    def _queue_s(self, prefill: int, requests: int) -> float:
        """The prefill ahead, in steps that each carry the running sequences, and
        those sequences riding along in the request's own step."""
        costs = self.profile.costs
        riders = requests * (costs.seq_s + costs.token_s + costs.lm_head_s)
        return (
            costs.token_s * prefill + prefill / self.step_tokens * (costs.step_s + riders) + riders
        )

    def _prefill_s(self, cached: int, uncached: int) -> float:
        """The request's own step, as the engine times it."""
        return self.profile.prefill_time(cached, uncached)

    def _load_function(self, requests: int, replicas: int) -> Load:
        """The queue ahead and the bound's overflow, in seconds."""
        cap = self.config.cache_aware.load_bound * (requests + 1) / replicas
        overflow_s = self.config.cache_aware.overflow_tokens * self._token_s

        def load_of(prefill: int, held: int) -> float:
            queued = self._queue_s(prefill, held)
            excess = held + 1 - cap
            return queued + overflow_s * excess if excess > 0 else queued

        return load_of

    def _recompute_cost(self, prompt: int, popular: int, cached: int) -> float:
        """The request's own prefill after ``cached`` tokens, and the reuse it forgoes."""
        shared = max(0, popular - cached)
        private = prompt - max(popular, cached)
        config = self.config
        reuse = (config.cache_aware.recompute_weight - 1) * shared + (
            config.cache_aware.private_recompute_weight - 1
        ) * private
        own = self._prefill_s(cached, prompt - cached) + self._token_s * reuse
        return self._miss_factor * own

    def _held_cost(self, prompt: int, popular: int, gpu: int, host: int, pulled: int = 0) -> float:
        loading = self.profile.load_time(host) if host else 0.0
        loading += self.moves.pull_s(pulled)
        return self._recompute_cost(prompt, popular, gpu + host + pulled) + loading

    def _cold_slack(self) -> float:
        return super()._cold_slack() * self._token_s

    def _adapter_cost(self, adapter: str, replica: ReplicaState) -> float:
        return super()._adapter_cost(adapter, replica) * self._token_s

    def _eviction_cost(self, replica: ReplicaState, uncached_tokens: int) -> float:
        return super()._eviction_cost(replica, uncached_tokens) * self._token_s

    # ------------------------------------------- what the load does not say

    def _unseen_by_load(self, replica: ReplicaState, uncached_tokens: int) -> float:
        return self._queued_attention_s(replica) + self._admission_s(replica, uncached_tokens)

    def _queued_attention_s(self, replica: ReplicaState) -> float:
        """The attention of the prompts this router queued there (another gateway's
        are known by their token count alone)."""
        pairs = sum(
            attention_pairs(r.predicted_cached_tokens or 0, r.predicted_uncached_tokens)
            for r in replica.in_flight.values()
            if r.prefilling
        )
        return self.profile.costs.attention_pair_s * pairs

    def _admission_s(self, replica: ReplicaState, uncached_tokens: int) -> float:
        """Seconds the request would wait at ``replica`` for KV blocks: none while
        they are free; else until running requests free the missing ones, each
        releasing its blocks once a lifetime (so the blocks in use come free at
        ``used / lifetime`` a second)."""
        free = replica.free_blocks
        if free is None or self.lifetime_s is None:
            return 0.0  # the engine does not say, or nothing has finished yet
        block = self.config.block_size
        pending = sum(
            math.ceil(r.predicted_uncached_tokens / block)
            for r in replica.in_flight.values()
            if r.prefilling
        )
        missing = math.ceil((uncached_tokens + 1) / block) + pending - free
        if missing <= 0:
            return 0.0
        used = max(replica.capacity_blocks - free, 1)
        return missing * self.lifetime_s / used

    def on_dispatch(self, request: RoutingRequest, replica: ReplicaState) -> None:
        super().on_dispatch(request, replica)
        self._dispatched_at[request.request_id] = self.clock()

    def on_complete(
        self, request: RoutingRequest, replica: ReplicaState, cached_tokens: int | None = None
    ) -> None:
        super().on_complete(request, replica, cached_tokens)
        start = self._dispatched_at.pop(request.request_id, None)
        if start is None:
            return
        lifetime = self.clock() - start
        previous = self.lifetime_s
        self.lifetime_s = (
            lifetime if previous is None else previous + LIFETIME_SMOOTHING * (lifetime - previous)
        )
