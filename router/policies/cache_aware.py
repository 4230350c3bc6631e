"""``cache_aware``: least total work, the prefill a replica would do plus its queue."""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, ClassVar

import numpy as np

from router.core import Clock, ReplicaState, RoutingRequest
from router.index.prefix_index import IndexConfig, PrefixPopularity
from router.policies.baselines import rendezvous, rendezvous_key
from router.policies.homes import Homes, HotPrefixes, SharedPrefixes
from router.policies.indexed import IndexedPolicy
from router.policies.kv_moves import KVMoves
from router.policies.load_order import Load, LoadOrder

if TYPE_CHECKING:
    from router.policies.registry import PolicyConfig


@dataclass(frozen=True)
class CacheAwareConfig:
    """``cache_aware``'s knobs (and those of the policies built on it), in prefill tokens."""

    #: What one running request weighs, to put queued prefill and running sequences
    #: in one unit (its decode steps slow the replica's batch).
    running_request_tokens: float = 256.0
    #: What an uncached prompt token costs, relative to a queued one. A queued token
    #: delays only this request; a token computed again is GPU work that every request
    #: queued after it waits for. A token of a popular prefix (shared by many recent
    #: requests, like a system prompt) weighs ``recompute_weight``: copying it to
    #: another replica is paid once and serves every later request there. A token of
    #: the conversation's own history weighs ``private_recompute_weight``: moving it is
    #: paid again on every move, and leaves a stale copy behind.
    recompute_weight: float = 4.0
    private_recompute_weight: float = 16.0
    #: A prefix is popular once this many recent requests passed through it (more
    #: than the turns of most conversations).
    popular_requests: int = 16
    #: What a token held in a replica's host tier costs: loading its KV over PCIe
    #: against computing it. Llama-3-8B moves 128 KiB a token, 2.6 us at 50 GB/s (PCIe
    #: 5) against 23 us of prefill on an H100 (0.11), 5.2 us at 25 GB/s (PCIe 4)
    #: against 74 us on an A100 (0.07): see replica/api/cost_model.py.
    host_token_cost: float = 0.1
    #: A cold prefix may go to any replica within this much work of the least loaded;
    #: among them the rendezvous choice wins, so routers agree.
    cold_slack_tokens: float = 512.0
    #: Bounded loads, made soft: a replica holding more than ``load_bound`` times the
    #: fleet's mean outstanding requests weighs ``overflow_tokens`` more per request
    #: beyond it. A short prefix moves away; a long private history may stay.
    load_bound: float = 1.5
    overflow_tokens: float = 2048.0
    #: What running a request's LoRA adapter costs where no GPU slot holds it, where
    #: the replica says its slots: a copy into a free slot (1.7 ms for rank 16 on
    #: Llama-3-8B over PCIe 5, about 75 tokens of an H100's prefill), or, with every
    #: slot's adapter running, a wait until one's requests have all finished: a few
    #: hundred decode steps, seconds (2.5 s is 100k tokens of an H100's prefill), which
    #: outweighs moving any history. On the mixed workload of docs/results.md, 8k, 32k
    #: and 128k gave its adapters a TTFT p99 of 5.9, 4.0, 2.5 s.
    adapter_load_tokens: float = 128.0
    adapter_wait_tokens: float = 131072.0
    #: A miss when no replica is idle is throughput the whole fleet loses: the tokens
    #: computed again are work every queued request waits behind, wherever it is. Each
    #: request waiting in the queue of the least queued engine (from their load reports
    #: or the router's own count) adds this to the recompute terms' factor (and the
    #: cold slack's), so a saturated fleet keeps a request where its prefix is unless
    #: the move pays for its recompute; while any replica has room, the price is as
    #: before (0: the same price at any load).
    saturation_weight: float = 1.0
    #: A prompt cached nowhere goes home, whatever the load (router/policies/homes.py):
    #: where the router placed its prefix before, when it was cached nowhere then too,
    #: so groups do not move. A prefix new to it goes, where new and shared prefixes
    #: crowd the caches (``crowded_share``), to the replica given the fewest homes among
    #: those within ``recompute_weight`` times its prefill of the least loaded; else,
    #: and off, among the near-least-loaded replicas (``cold_slack_tokens``), where it
    #: evicts the least.
    homes: bool = True
    #: What a copy made for load pays for each hot token it would evict: on a replica
    #: whose hot working set (the shared prefixes routed to it within the last
    #: ``hot_window_requests`` requests) and the copy's uncached tokens pass ``hot_fill``
    #: of its KV cache, each token beyond costs this many prefill tokens (a hot token
    #: evicted is computed again later). 0: a copy pays no eviction.
    eviction_weight: float = 16.0
    hot_fill: float = 0.6
    hot_window_requests: int = 1000
    #: Copies pay for their evictions only where shared prefixes crowd the caches: while
    #: the prefixes that different requests shared within the last
    #: ``hot_window_requests`` requests need this share of the fleet's KV cache or more
    #: (0: always), and some replica has no queue. New prefixes go to the fewest homes
    #: while those and the prompts placed cold need this share together, and before the
    #: policy first looks (``CROWDING_EVERY`` requests). There a group that
    #: moves evicts another group, which moves in turn; on a chat fleet, whose caches
    #: hold conversations' histories, balance pays instead, and past capacity every
    #: recompute is dear already (``saturation_weight``) and a copy drains a queue.
    crowded_share: float = 0.3

    def __post_init__(self) -> None:
        if self.running_request_tokens < 0 or self.cold_slack_tokens < 0:
            raise ValueError("running_request_tokens and cold_slack_tokens must not be negative")
        if self.host_token_cost < 0 or self.saturation_weight < 0:
            raise ValueError("host_token_cost and saturation_weight must not be negative")
        if self.recompute_weight <= 0 or self.private_recompute_weight <= 0:
            raise ValueError("recompute_weight and private_recompute_weight must be positive")
        if self.eviction_weight < 0 or self.hot_fill <= 0 or self.hot_window_requests < 1:
            raise ValueError(
                "eviction_weight must not be negative, hot_fill positive "
                "and hot_window_requests at least 1"
            )
        if self.crowded_share < 0:
            raise ValueError("crowded_share must not be negative")
        if self.load_bound < 1 or self.overflow_tokens < 0 or self.popular_requests < 1:
            raise ValueError(
                "load_bound must be at least 1, overflow_tokens not negative "
                "and popular_requests positive"
            )


#: Requests between two looks at whether shared prefixes crowd the fleet's caches (a
#: look sums the fleet's KV blocks).
CROWDING_EVERY = 10


class CacheAware(IndexedPolicy):
    """Least total work: the prefill a replica would do plus the work queued on it.

    cost(replica) = S x recompute_weight x uncached tokens of a popular prefix there
                  + S x private_recompute_weight x the request's other uncached tokens
                  + host_token_cost x tokens it holds in its host tier only
                  + its outstanding prefill tokens
                  + running_request_tokens x its outstanding requests
                  + overflow_tokens x its outstanding requests beyond the load bound

    all in prefill tokens, S the fleet's saturation (1 + ``saturation_weight`` x the
    requests waiting on the least queued replica: 1 while any has room). Lowest cost
    wins, ties at random. A popular prefix (a system prompt many sessions share) is
    cheap to copy to a less loaded replica, so new sessions spread; a conversation's
    own history is dear to move, so its next turn stays where it is cached. The load
    bound, ``load_bound`` (1.5) times the fleet's mean outstanding requests
    (consistent hashing with bounded loads, Mirrokni et al. 2018, made soft), keeps a
    lightly loaded fleet even, where the queue terms hardly weigh.

    A hot shared prompt cached on one replica is copied to another as soon as the
    first replica's queue outweighs the copy, so it never stays pinned while others
    idle; each request weighs its own cached tokens, so affinity is never dropped for
    all requests at once (SGLang's fleet-wide imbalance switch does that). A prefix
    cached nowhere goes where it evicts the least: among the near-least-loaded replicas,
    those with free blocks for it, by rendezvous among equals, so independent routers
    reading the same events send the same new prefix to the same place.

    A token held in a replica's host tier (learned from its KV events) costs its load
    over PCIe, a tenth of computing it by default: a GPU hit is preferred to a host
    hit, and a host hit to a miss.
    """

    name = "cache_aware"
    #: Whether tokens in a replica's host tier count as held (the tier-blind variant
    #: counts them as misses, as a router that follows only GPU evictions would).
    tier_aware: ClassVar[bool] = True
    #: Whether a replica's cost depends on more than its load and what it holds, so
    #: that the fleet path (which orders replicas by load alone) cannot stand in.
    prices_every_replica: ClassVar[bool] = False
    #: Whether it weighs where a request's LoRA adapter sits in GPU slots.
    adapter_aware: ClassVar[bool] = True

    def __init__(self, config: PolicyConfig, clock: Clock, rng: np.random.Generator) -> None:
        self.popularity = PrefixPopularity()
        #: The recompute terms' factor for the decision under way (_saturation_factor).
        self._miss_factor = 1.0
        self._request: RoutingRequest | None = None  # the decision under way's
        self._hot_key: int | None = None  # its shared prefix's, where copies pay
        self.order = LoadOrder()  # filled by on_replica_added, kept by router/fleet/load.py
        self.moves = KVMoves(config.kv, config.ttft.cost_profile)
        knobs = config.cache_aware
        #: Where prefixes cached nowhere live, the hot prefixes a copy would evict, and
        #: whether shared prefixes crowd the fleet's caches, so that copies pay (``homes``,
        #: ``eviction_weight``, ``crowded_share``: router/policies/homes.py).
        self.cold_homes = (
            Homes(config.index, config.block_size, clock, config.model) if knobs.homes else None
        )
        self.hot_prefixes = (
            HotPrefixes(knobs.hot_window_requests) if knobs.eviction_weight else None
        )
        self.shared_prefixes = (
            SharedPrefixes(knobs.hot_window_requests, config.stride_tokens)
            if (knobs.homes or knobs.eviction_weight) and knobs.crowded_share
            else None
        )
        #: Whether the shared prefixes crowd the caches (copies pay for evictions), and
        #: whether they and the prompts placed cold do (new prefixes placed as groups).
        #: Until the first look nothing says how crowded the caches will be, and a
        #: fleet's first new prefixes decide where its groups live: they spread as groups
        #: (rendezvous put a 2-replica demo's popular applications together, its busy
        #: replica evicting the histories its sessions came back for).
        self.crowded = not knobs.crowded_share
        self.placing_groups = True
        super().__init__(config, clock, rng)

    def choose(self, request: RoutingRequest, replicas: Sequence[ReplicaState]) -> ReplicaState:
        self._request = request  # what an eviction's price is of
        if self.hot_prefixes is not None and request.stride_hashes:
            self._hot_key = self._shared_prefix(request)[0]  # once a decision
        whole_fleet = bool(self.order) and len(replicas) == len(self.order)
        self._miss_factor = self._saturation_factor(replicas, whole_fleet)
        matched = self._matches(request, replicas)
        host = self._host_matches(request, matched) if self.tier_aware else {}
        popular = self.popular_tokens(request)
        priced = self._with_session(request, replicas, matched)
        pulls = self._pullable(replicas, matched, host) if self.config.kv.peer_pulls else {}
        adapter = request.adapter if self.adapter_aware else None
        if whole_fleet and not self.prices_every_replica and adapter is None and not pulls:
            chosen = self._choose_in_fleet(request, priced, host, popular)
        else:  # replicas full, a retry, an adapter, a variant's price, pulls: one by one
            chosen = self._choose_by_scan(request, replicas, priced, host, popular, adapter, pulls)
        # the engine reports host hits as cached
        request.predicted_cached_tokens = matched.get(chosen.replica_id, 0) + host.get(
            chosen.replica_id, 0
        )
        if self.config.kv.peer_pulls and not host.get(chosen.replica_id):
            self.moves.plan_pull(request, chosen, matched, self.order.states)
        return chosen

    def _choose_in_fleet(
        self, request: RoutingRequest, matched: dict[str, int], host: dict[str, int], popular: int
    ) -> ReplicaState:
        """The scan's choice at the cost of the warm replicas alone: every cold replica
        costs the same recomputation, so the cheapest by load stands for them all (and
        those tied with it, in case they tie with the best)."""
        order = self.order
        load_of = self._load_function(order.total_requests, len(order))
        warm = matched.keys() | host.keys()
        if not warm:
            least = order.cheapest(load_of)
            assert least is not None
            near = order.within(load_of, least.load + self._cold_slack())
            return self._roomiest(request, near)
        prompt = request.num_prompt_tokens
        costs = {}
        for replica_id in warm:
            state = order.states[replica_id]
            load = load_of(state.load_prefill_tokens, state.load_requests)
            gpu, in_host = matched.get(replica_id, 0), host.get(replica_id, 0)
            held = self._held_cost(prompt, popular, gpu, in_host)
            costs[replica_id] = load + held + self._eviction_cost(state, prompt - gpu - in_host)
        costs |= self._cheapest_cold(request, load_of, warm, popular, min(costs.values()))
        best = min(costs.values())
        tied = [replica_id for replica_id, cost in costs.items() if cost == best]
        tied.sort(key=order.rank.__getitem__)  # as the scan lists them, so ties break alike
        return self._pick([order.states[replica_id] for replica_id in tied])

    def _cheapest_cold(
        self,
        request: RoutingRequest,
        load_of: Load,
        warm: Collection[str],
        popular: int,
        bound: float,
    ) -> dict[str, float]:
        """The cold replicas (holding none of the prompt) that may cost ``bound`` or
        less, and their costs: those at the least load, or, where copies pay for what
        they evict, every one whose load alone leaves room under the best found (the
        price is never negative, so the others cannot win)."""
        order = self.order
        cold = order.cheapest(load_of, skip=warm)
        if cold is None:
            return {}
        recompute = self._recompute_cost(request.num_prompt_tokens, popular, 0)
        members = [order.states[replica_id] for replica_id in cold.members(skip=warm)]
        if not self._pays_evictions():
            return {replica.replica_id: cold.load + recompute for replica in members}
        prompt = request.num_prompt_tokens
        prices = {replica.replica_id: self._eviction_cost(replica, prompt) for replica in members}
        least = min(prices.values())
        if not least:  # one at the least load evicts nothing hot: none further can be cheaper
            return {replica_id: cold.load + recompute + p for replica_id, p in prices.items()}
        ceiling = min(bound, cold.load + recompute + least) - recompute
        costs = {}
        for replica in order.within(load_of, ceiling + 1.0):  # a token over: no tie lost
            if replica.replica_id not in warm:
                load = load_of(replica.load_prefill_tokens, replica.load_requests)
                costs[replica.replica_id] = load + recompute + self._eviction_cost(replica, prompt)
        return costs

    def _choose_by_scan(
        self,
        request: RoutingRequest,
        replicas: Sequence[ReplicaState],
        matched: dict[str, int],
        host: dict[str, int],
        popular: int,
        adapter: str | None = None,
        pulls: dict[str, int] | None = None,
    ) -> ReplicaState:
        """Every candidate priced: the reference that the fleet path must agree with
        (``pulls``: the tokens each could pull from a peer, priced as their pull)."""
        pulls = pulls or {}
        load_of = self._load_function(sum(r.load_requests for r in replicas), len(replicas))
        loads = [load_of(r.load_prefill_tokens, r.load_requests) for r in replicas]
        prompt = request.num_prompt_tokens
        if self.prices_every_replica:  # what each replica's load does not say
            held = [matched.get(r.replica_id, 0) + host.get(r.replica_id, 0) for r in replicas]
            unseen = [
                self._unseen_by_load(r, prompt - h) for r, h in zip(replicas, held, strict=True)
            ]
            loads = [load + extra for load, extra in zip(loads, unseen, strict=True)]
        if adapter is not None:
            loads = [
                load + self._adapter_cost(adapter, r)
                for load, r in zip(loads, replicas, strict=True)
            ]
        if not host and not any(matched.values()) and not pulls:
            # a cold prompt under an adapter goes where a slot holds it, else where the
            # adapter's other prompts go (all routers agree): it stays in few slots,
            # among the near-least-loaded replicas (homes or not)
            slack = self._cold_slack() if adapter is None else self._load_slack()
            ceiling = min(loads) + slack
            near = [r for r, load in zip(replicas, loads, strict=True) if load <= ceiling]
            if adapter is None:
                return self._roomiest(request, near)
            holding = [r for r in near if not self._adapter_cost(adapter, r)]
            return rendezvous(adapter.encode(), holding or near)
        nothing_cached = self._recompute_cost(prompt, popular, 0)  # most replicas, often
        costs = [
            load
            + (
                self._held_cost(
                    prompt,
                    popular,
                    matched.get(r.replica_id, 0),
                    host.get(r.replica_id, 0),
                    pulls.get(r.replica_id, 0),
                )
                if r.replica_id in matched or r.replica_id in host or r.replica_id in pulls
                else nothing_cached
            )
            + self._eviction_cost(
                r, prompt - matched.get(r.replica_id, 0) - host.get(r.replica_id, 0)
            )
            for r, load in zip(replicas, loads, strict=True)
        ]
        best = min(costs)
        return self._pick([r for r, cost in zip(replicas, costs, strict=True) if cost == best])

    def _held_cost(self, prompt: int, popular: int, gpu: int, host: int, pulled: int = 0) -> float:
        """The work of a replica holding ``gpu`` leading tokens, then ``host`` more,
        then ``pulled`` more it could pull from a peer."""
        loading = self.config.cache_aware.host_token_cost * host if host else 0.0
        if pulled:  # the pull's seconds, in prefill tokens
            loading += self.moves.pull_s(pulled) / self.moves.profile.costs.token_s
        return self._recompute_cost(prompt, popular, gpu + host + pulled) + loading

    def _pullable(
        self, replicas: Sequence[ReplicaState], matched: dict[str, int], host: dict[str, int]
    ) -> dict[str, int]:
        """The tokens each candidate could pull beyond what it holds: up to the longest
        prefix a peer's GPU holds (``--peer-pulls``)."""
        top = max(matched.values(), default=0)
        pulls = {}
        for replica in replicas:
            held = matched.get(replica.replica_id, 0) + host.get(replica.replica_id, 0)
            if top > held:
                pulls[replica.replica_id] = top - held
        return pulls

    def _roomiest(self, request: RoutingRequest, near: Sequence[ReplicaState]) -> ReplicaState:
        """Where a prefix cached nowhere goes among ``near``: where it evicts the least
        (the prompt's blocks beyond the free blocks of the replica's GPU, as its events
        say), by rendezvous among those tied (every router reads the same events, so
        routers agree): among replicas with room, or among full ones, as before.

        (Preferring the replica with the fewest blocks outright balanced a KV-short
        fleet's groups better, but made a chat's new sessions follow the emptiest
        replica and load it: ``make demo``'s TTFT p99 63 to 87 ms in replay.)
        """
        homes = self.cold_homes if self._goes_home() else None
        if self.shared_prefixes is not None and self._has_prefix():
            self.shared_prefixes.placed_cold(request.stride_hashes)
        if homes is not None and (self.placing_groups or homes.knows(request)):
            return homes.home(request, near, self._outstanding)
        chosen = near[0] if len(near) == 1 else self._least_evicting(request, near)
        if homes is not None:
            homes.placed(request, chosen)
        return chosen

    def _outstanding(self, replica: ReplicaState) -> float:
        """``replica``'s queued prefill and running requests, in prefill tokens."""
        per_request = self.config.cache_aware.running_request_tokens
        return replica.load_prefill_tokens + per_request * replica.load_requests

    def _least_evicting(
        self, request: RoutingRequest, near: Sequence[ReplicaState]
    ) -> ReplicaState:
        """Where ``request`` evicts the least among ``near``, by rendezvous among ties."""
        evicted = [self._evicted_blocks(r, request.num_prompt_tokens) for r in near]
        least = min(evicted)
        roomiest = [r for r, e in zip(near, evicted, strict=True) if e == least]
        return rendezvous(rendezvous_key(request), roomiest)

    def _evicted_blocks(self, replica: ReplicaState, tokens: int) -> int:
        """The blocks a replica would evict to compute ``tokens`` now: those beyond the
        free blocks of its GPU, as the index knows them."""
        config = self.config
        held = self.index.gpu_keys(replica.replica_id) * config.index.stride
        needed = -(-tokens // config.block_size)
        return max(0, needed - max(0, replica.capacity_blocks - held))

    def _cold_slack(self) -> float:
        """How far above the least loaded replica a prompt cached nowhere may go: home,
        however far (``homes``); a prefix new to the homes, as far as a popular prefix's
        copy would cost (it may be a group's first request, and where it lands, the
        group lives), to the replica given the fewest homes."""
        if not self._goes_home():
            return self._load_slack()
        assert self.cold_homes is not None and self._request is not None
        if self.cold_homes.knows(self._request):
            return math.inf  # every replica is a candidate: the home decides
        if not self.placing_groups:
            return self._load_slack()
        new = self.config.cache_aware.recompute_weight * self._request.num_prompt_tokens
        return self._load_slack() + new

    def _goes_home(self) -> bool:
        """Whether the request under way, cached nowhere, goes home (``homes``): if it
        is a stride long or more."""
        return self.cold_homes is not None and self._has_prefix()

    def _pays_evictions(self) -> bool:
        """Whether a copy pays for the hot prefixes it evicts (``eviction_weight``): while
        shared prefixes crowd the caches and some replica has no queue."""
        return self.hot_prefixes is not None and self.crowded and self._miss_factor == 1.0

    def _has_prefix(self) -> bool:
        """Whether the request under way is a stride long or more (has a home)."""
        return self._request is not None and bool(self._request.stride_hashes)

    def _load_slack(self) -> float:
        return self.config.cache_aware.cold_slack_tokens * self._miss_factor

    # ------------------------------------------------------------ evictions

    def _eviction_cost(self, replica: ReplicaState, uncached_tokens: int) -> float:
        """What computing ``uncached_tokens`` of the request under way on ``replica``
        evicts of its hot prefixes, in prefill tokens (``eviction_weight``)."""
        hot = self.hot_prefixes
        if hot is None or uncached_tokens <= 0 or not self._has_prefix():
            return 0.0
        if not self._pays_evictions():  # shared prefixes do not crowd, or every replica queues
            return 0.0
        knobs, block = self.config.cache_aware, self.config.block_size
        room = replica.capacity_blocks * block * knobs.hot_fill
        over = hot.tokens(replica.replica_id, but=self._hot_key) + uncached_tokens - room
        return knobs.eviction_weight * min(max(0.0, over), uncached_tokens)

    def _shared_prefix(self, request: RoutingRequest) -> tuple[int, int]:
        """The request's shared prefix (by two recent requests or more; else its whole
        prompt, maybe a new group's): its last stride's identity and its tokens."""
        depth = self.popularity.depth(request.stride_hashes, 2) or len(request.stride_hashes)
        stride_tokens = self.config.block_size * self.config.index.stride
        return request.stride_hashes[depth - 1], depth * stride_tokens

    # ------------------------------------------------------------ sessions

    def _with_session(
        self, request: RoutingRequest, replicas: Sequence[ReplicaState], matched: dict[str, int]
    ) -> dict[str, int]:
        """The matches, with a session's home priced as holding its prompt.

        The home is where rendezvous hashing of the session's key sends it: the same
        replica for every router, with nothing to share between them, so routers that
        learn only from their own decisions send every turn of a session to one place
        (a turn that had to leave an overloaded home comes back to it). Only a replica
        known from decisions alone is assumed to hold it: a precise replica's events
        say what it holds, the session's history included. The load terms still
        weigh, so an overloaded home is left.
        """
        if request.session is None:
            return matched
        home = rendezvous(request.session.encode(), replicas)
        if self.index.is_precise(home.replica_id):
            return matched
        held = max(matched.get(home.replica_id, 0), self._limit(request))
        return {**matched, home.replica_id: held}

    def _adapter_cost(self, adapter: str, replica: ReplicaState) -> float:
        """Running ``adapter`` on ``replica``: nothing where a GPU slot holds it (or the
        replica does not say), else its copy into a free slot, or a wait for one."""
        loaded = replica.loaded_adapters
        if loaded is None or adapter in loaded:
            return 0.0
        if replica.free_adapter_slots == 0:
            return self.config.cache_aware.adapter_wait_tokens
        return self.config.cache_aware.adapter_load_tokens

    def _unseen_by_load(self, replica: ReplicaState, uncached_tokens: int) -> float:
        """What ``replica``'s load (its queued prefill tokens and requests) does not
        say of a request with ``uncached_tokens`` to compute there: priced by variants
        that set ``prices_every_replica``."""
        return 0.0

    def on_dispatch(self, request: RoutingRequest, replica: ReplicaState) -> None:
        super().on_dispatch(request, replica)
        self.popularity.record(request.stride_hashes)
        if self.hot_prefixes is not None:
            key, tokens = self._shared_prefix(request) if request.stride_hashes else (None, 0)
            self.hot_prefixes.routed(replica.replica_id, key, tokens)
        if self.shared_prefixes is not None:
            self._note_sharing(request)

    def _note_sharing(self, request: RoutingRequest) -> None:
        """Count the request's shared prefix; every ``CROWDING_EVERY`` requests, look
        again at whether shared prefixes crowd the fleet's KV cache."""
        shared = self.shared_prefixes
        assert shared is not None
        seen = shared.seen
        shared.record(request.request_id, request.stride_hashes)
        if shared.seen == seen or shared.seen % CROWDING_EVERY:
            return
        fleet_tokens = self.config.block_size * sum(
            replica.capacity_blocks for replica in self.order.states.values()
        )
        if fleet_tokens:
            share = self.config.cache_aware.crowded_share
            shared_share, with_cold = shared.needs(fleet_tokens)
            self.crowded, self.placing_groups = shared_share >= share, with_cold >= share

    def cache_value(self, replica_id: str) -> float:
        """The recent requests through the prefixes it alone holds (each at least
        once): a popular prefix only it holds weighs what it will be asked for, a
        finished conversation's history little."""
        count = self.popularity.count
        return float(sum(max(1, count(key)) for key in self.index.exclusive_keys(replica_id)))

    def popular_tokens(self, request: RoutingRequest) -> int:
        """Leading tokens of the request that many recent requests shared."""
        config = self.config
        depth = self.popularity.depth(request.stride_hashes, config.cache_aware.popular_requests)
        return min(depth * config.block_size * config.index.stride, request.num_prompt_tokens)

    def _recompute_cost(self, prompt: int, popular: int, cached: int) -> float:
        """Uncached tokens, those of the popular prefix and the request's own apart,
        dearer as the fleet saturates."""
        shared = max(0, popular - cached)
        own = prompt - max(popular, cached)
        return self._miss_factor * (
            self.config.cache_aware.recompute_weight * shared
            + self.config.cache_aware.private_recompute_weight * own
        )

    def _saturation_factor(self, replicas: Sequence[ReplicaState], whole_fleet: bool) -> float:
        """What a miss weighs now against an idle fleet's price: 1, plus
        ``saturation_weight`` for every request waiting on the least queued replica
        (``ReplicaState.load_waiting``; of the whole fleet, found in its load order):
        while any replica has room, a recompute there costs the fleet no throughput,
        and the price is today's."""
        weight = self.config.cache_aware.saturation_weight
        if not (weight and replicas):
            return 1.0
        if whole_fleet:
            return 1.0 + weight * self.order.least_waiting()
        return 1.0 + weight * min(r.load_waiting for r in replicas)

    def _load_function(self, requests: int, replicas: int) -> Load:
        """A replica's load in prefill tokens: its queued prefill, its requests, and
        those beyond the bound of ``load_bound`` times the fleet's mean (which counts
        this request)."""
        config = self.config
        cap = config.cache_aware.load_bound * (requests + 1) / replicas
        per_request, overflow = (
            config.cache_aware.running_request_tokens,
            config.cache_aware.overflow_tokens,
        )

        def load_of(prefill: int, held: int) -> float:
            queued = prefill + per_request * held
            excess = held + 1 - cap
            return queued + overflow * excess if excess > 0 else queued

        return load_of

    # ------------------------------------------------------------ the fleet

    def on_replica_added(self, replica: ReplicaState) -> None:
        super().on_replica_added(replica)
        self.order.update(replica)
        replica.on_load_change = self.order.update

    def on_replica_removed(self, replica: ReplicaState) -> None:
        super().on_replica_removed(replica)
        self.order.remove(replica.replica_id)
        if self.cold_homes is not None:
            self.cold_homes.remove(replica.replica_id)
        if self.hot_prefixes is not None:
            self.hot_prefixes.remove(replica.replica_id)
        if replica.on_load_change == self.order.update:
            replica.on_load_change = None


class CacheAwareTierBlind(CacheAware):
    """``cache_aware`` that counts a replica's host-tier tokens as misses: the baseline
    that shows what knowing the tiers buys."""

    name = "cache_aware_tier_blind"
    tier_aware = False


class CacheAwareAdapterBlind(CacheAware):
    """``cache_aware`` that does not know where adapters sit in GPU slots (it still
    routes by model, and its identities are the adapters'): the baseline that shows
    what weighing the slots buys."""

    name = "cache_aware_adapter_blind"
    adapter_aware = False


class CacheAwareApproximate(CacheAware):
    """``cache_aware`` with an index that learns only from its own routing decisions."""

    name = "cache_aware_approx"

    def _index_config(self, config: PolicyConfig) -> IndexConfig:
        return replace(config.index, mode="approximate")
