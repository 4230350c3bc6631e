"""The gateway's routing state: the policy, the backends, the admission queue, the counters.

One :class:`Gateway` per app. It turns a prompt into what the policy sees (block
identities at every ``stride``-th boundary, seeded as the replicas seed them),
admits requests while replicas of their model have room, and switches policies at
run time; each model served has a policy of its own (``router/models.py``). The
request path is ``router/upstream.py``; the HTTP handlers are ``router/app.py``.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import replace

import aiohttp
import numpy as np

from replica.api import openai as api
from replica.api.identity import affinity_key, identity_seed
from replica.api.model_tokenizer import HFTokenizer, load_tokenizer
from replica.api.tokenizer import Tokenizer
from router import cache_budget
from router.accounting import Accounting
from router.admission import AdmissionQueue
from router.backend_check import BackendCheck
from router.backends import BackendPool
from router.config import GatewayConfig
from router.fairness import FairShare
from router.hot_prefixes import HotPrefixes
from router.key_cache import PrefixKeyCache
from router.metrics import GatewayMetrics
from router.models import ModelRoutes, ServedName
from router.policies import Policy, ReplicaState, RoutingRequest, make_policy
from router.policies.indexed import IndexedPolicy
from router.policies.replicated import CacheAwareReplicated
from router.slots import with_free_slot
from router.stats import GatewayStats, HotSetStats

#: The most cache salts whose tenant the gateway remembers.
MAX_SALTS = 65_536


class Gateway:
    def __init__(self, config: GatewayConfig, client: aiohttp.ClientSession) -> None:
        self.config = config
        self.tokenizer: Tokenizer = load_tokenizer(
            config.tokenizer, config.chat_template, config.tokenizer_cache_tokens
        )
        self.prefix_keys = PrefixKeyCache(
            config.routing.block_size, config.routing.index.stride, config.key_cache_tokens
        )
        self.rng = np.random.default_rng(config.seed)
        self.policy_name = config.policy
        self.models = ModelRoutes(self._policy_for, config.model)
        routing = config.routing
        check = BackendCheck(
            client, self.tokenizer, config.model, routing.block_size, routing.index.stride
        )
        self.pool = BackendPool(
            client,
            on_events=self.models.events,
            on_added=self._added,
            on_removed=self.models.removed,
            poll_interval_s=config.kv_events_interval_s,
            default_capacity_blocks=config.capacity_blocks,
            check=check if config.check_backends else None,
            describe_interval_s=config.describe_interval_s,
        )
        self.admission = AdmissionQueue(
            config.max_queued,
            config.queue_timeout_s,
            FairShare(config.fairness, config.fair_half_life_s),
            can_serve=lambda request: bool(self.available(request)),
        )
        self.accounting = Accounting(routing.stride_tokens, block_tokens=routing.block_size)
        self.metrics = GatewayMetrics(
            self.accounting, self.pool, self.admission, self.tenant_footprint
        )
        #: Which tenant each cache salt seen belongs to, and each tenant's salts: blocks
        #: in the index carry the salt only. Bounded: salts a tenant's own
        #: ``cache_salt`` spells are unbounded.
        self.salt_tenants: dict[str, str] = {}
        self.tenant_salts: dict[str, set[str]] = {}
        board = config.dashboard
        self.hot_prefixes = HotPrefixes(
            board.hot_prefixes_kept, board.hot_prefix_half_life, board.hot_prefix_sample_tokens
        )

    def _policy_for(self, model: str) -> Policy:
        routing = replace(self.config.routing, model=model)  # it seeds the model's index
        return make_policy(self.policy_name, time.monotonic, self.rng, routing)

    @property
    def policy(self) -> Policy:
        """The default model's policy (the only one in a fleet of one model)."""
        return self.models.policy()

    def policy_of(self, request: RoutingRequest) -> Policy:
        return self.models.policy(request.model)

    def switch_policy(self, name: str) -> None:
        """Route with ``name`` from now on; the new policies learn the fleet afresh."""
        make_policy(name, time.monotonic, self.rng, self.config.routing)  # refused here if bad
        self.policy_name = name
        self.models.switch(self._policy_for)

    def _added(self, state: ReplicaState) -> None:
        self.models.added(state)
        self.admission.slot_freed()  # requests for its model may be waiting for it

    def resolve(self, model: object) -> ServedName:
        """What a request's ``model`` field names; 404, as vLLM answers, if no replica
        serves it."""
        name = model if isinstance(model, str) else None
        served = self.models.resolve(name)
        if served is None:
            known = ", ".join(name for name, _ in self.models.names())
            raise api.Rejected(f"the model {name!r} does not exist (served: {known})", 404, "model")
        return served

    def routing_request(
        self,
        prompt: np.ndarray,
        cache_salt: str | None,
        tenant: str | None = None,
        served: ServedName | None = None,
    ) -> RoutingRequest:
        """Hash the prompt as a replica will: seeded by model (or adapter) and salt."""
        served = served or ServedName(self.config.model)
        seed = identity_seed(served.name, cache_salt)  # one short hash, no cache to grow
        if tenant is not None and cache_salt is not None:
            self._learn_salt(cache_salt, tenant)
        routing = self.config.routing
        block_size, stride = routing.block_size, routing.index.stride
        hashes = self.prefix_keys.keys(prompt, seed)
        self.hot_prefixes.record(hashes, prompt)  # for the dashboard: one dict update
        return RoutingRequest(
            api.new_id("route"), len(prompt), hashes, tenant=tenant,
            model=served.model, adapter=served.adapter,
            affinity=affinity_key(prompt, block_size, stride, seed),
        )  # fmt: skip

    def _learn_salt(self, salt: str, tenant: str) -> None:
        if salt not in self.salt_tenants and len(self.salt_tenants) < MAX_SALTS:
            self.salt_tenants[salt] = tenant
            self.tenant_salts.setdefault(tenant, set()).add(salt)

    def tenant_footprint(self) -> dict[str, dict[str, int]]:
        """Each tenant's blocks on each replica's GPU (by replica id), as the precise
        indexes know them from the replicas' events."""
        footprint: dict[str, dict[str, int]] = {}
        for policy in self.models.policies.values():
            if not isinstance(policy, IndexedPolicy):
                continue
            for replica_id in policy.index.replicas:
                for salt, blocks in policy.index.gpu_blocks_by_salt(replica_id).items():
                    tenant = self.salt_tenants.get(salt) if salt is not None else None
                    if tenant is not None:
                        held = footprint.setdefault(tenant, {})
                        held[replica_id] = held.get(replica_id, 0) + blocks
        return footprint

    def cache_values(self) -> dict[str, float]:
        """Each backend's cache value (``Policy.cache_value``), by replica id."""
        return {
            state.replica_id: self.models.policy(state.model).cache_value(state.replica_id)
            for state in (backend.state for backend in self.pool.backends)
        }

    def hot_sets(self) -> list[HotSetStats]:
        """Each model's hot prefixes on several replicas, largest share first."""
        sets = [
            HotSetStats(f"{hot.key:016x}", model, hot.share, list(hot.replicas))
            for model, policy in self.models.policies.items()
            if isinstance(policy, CacheAwareReplicated)
            for hot in policy.hot_sets()
        ]
        return sorted(sets, key=lambda s: -s.share)

    def within_budget(
        self, policy: Policy, request: RoutingRequest, candidates: Sequence[ReplicaState]
    ) -> Sequence[ReplicaState]:
        """The candidates a request of a tenant with a cache budget may go to."""
        if request.cache_budget is None or request.tenant is None:
            return candidates
        salts = self.tenant_salts.get(request.tenant, ())
        return cache_budget.within_budget(policy, request, candidates, salts)

    async def admit(self, request: RoutingRequest) -> list[ReplicaState]:
        """The replicas of the request's model with a free slot, once its turn has
        come; raises :class:`~router.admission.Overloaded` when the queue is full or too
        slow."""
        # None waits, or this tenant is within its share: a free slot is one the waiting
        # could not take (the reserve), or is about to be taken (one is woken for it).
        if not len(self.admission) or self.admission.fair.within_share(request):
            states = self.available(request)
            if states:
                return states
        deadline, again = self.admission.deadline(), False
        while True:  # woken when a slot frees; another request may have taken it
            await self.admission.wait_turn(deadline, request, again)
            states = self.available(request)
            if states:
                return states
            again = True

    def serving(self, request: RoutingRequest) -> list[ReplicaState]:
        """Healthy replicas that serve the request's model (and adapter)."""
        states = self.pool.states
        if request.adapter is None and len(self.models.policies) <= 1:
            return states  # one model: every replica serves it
        served = ServedName(request.model or self.models.default_model, request.adapter)
        return self.models.serving(served, states)

    def available(self, request: RoutingRequest) -> list[ReplicaState]:
        """Those of :meth:`serving` with a slot free for the request: below their cap
        of requests in flight, less the reserve for a tenant beyond its share, over
        it on its home for one within (router/slots.py)."""
        config = self.config
        return with_free_slot(
            request, self.serving(request), self.admission.fair,
            config.max_outstanding_per_replica, config.fair_reserve_per_replica,
            lambda: self.policy_of(request).holders(request),
        )  # fmt: skip

    def stats(self) -> GatewayStats:
        stats = self.accounting.stats(
            self.policy_name, self.config, self.pool, self.admission, self.tenant_footprint()
        )
        stats = replace(stats, key_cache=self.prefix_keys.stats(), hot_sets=self.hot_sets())
        if isinstance(self.tokenizer, HFTokenizer) and self.tokenizer.pieces is not None:
            return replace(stats, tokenizer_cache=self.tokenizer.pieces.stats())
        return stats
