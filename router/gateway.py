"""The gateway's routing state: the policy, the backends, the admission queue, the counters.

One :class:`Gateway` per app. It turns a prompt into what the policy sees (block
identities at every ``stride``-th boundary, seeded as the replicas seed them),
admits requests while replicas have room, and switches policies at run time. The
request path is ``router/upstream.py``; the HTTP handlers are ``router/app.py``.
"""

from __future__ import annotations

import time

import aiohttp
import numpy as np

from replica.api import openai as api
from replica.api.identity import identity_seed, prefix_keys
from replica.api.model_tokenizer import load_tokenizer
from replica.api.tokenizer import Tokenizer
from router.accounting import Accounting
from router.admission import AdmissionQueue
from router.backend_check import BackendCheck
from router.backends import BackendPool
from router.config import GatewayConfig
from router.hot_prefixes import HotPrefixes
from router.metrics import GatewayMetrics
from router.policies import Policy, ReplicaState, RoutingRequest, make_policy
from router.stats import GatewayStats


class Gateway:
    def __init__(self, config: GatewayConfig, client: aiohttp.ClientSession) -> None:
        self.config = config
        self.tokenizer: Tokenizer = load_tokenizer(config.tokenizer, config.chat_template)
        self.rng = np.random.default_rng(config.seed)
        self.policy: Policy = self._make_policy(config.policy)
        routing = config.routing
        check = BackendCheck(
            client, self.tokenizer, config.model, routing.block_size, routing.index.stride
        )
        self.pool = BackendPool(
            client,
            on_events=lambda state, events: self.policy.on_kv_events(state, events),
            on_added=lambda state: self.policy.on_replica_added(state),
            on_removed=lambda state: self.policy.on_replica_removed(state),
            poll_interval_s=config.kv_events_interval_s,
            default_capacity_blocks=config.capacity_blocks,
            check=check if config.check_backends else None,
        )
        self.admission = AdmissionQueue(config.max_queued, config.queue_timeout_s)
        self.accounting = Accounting(routing.stride_tokens, block_tokens=routing.block_size)
        self.metrics = GatewayMetrics(self.accounting, self.pool, self.admission)
        board = config.dashboard
        self.hot_prefixes = HotPrefixes(
            board.hot_prefixes_kept, board.hot_prefix_half_life, board.hot_prefix_sample_tokens
        )

    def _make_policy(self, name: str) -> Policy:
        return make_policy(name, time.monotonic, self.rng, self.config.routing)

    def switch_policy(self, name: str) -> None:
        """Route with ``name`` from now on; the new policy learns the fleet afresh."""
        policy = self._make_policy(name)
        for state in self.pool.states:
            policy.on_replica_added(state)
        self.policy = policy

    def routing_request(
        self, prompt: np.ndarray, cache_salt: str | None, tenant: str | None = None
    ) -> RoutingRequest:
        """Hash the prompt as a replica will: seeded by model and (tenant) salt."""
        seed = identity_seed(self.config.model, cache_salt)  # one short hash, no cache to grow
        hashes = prefix_keys(prompt, self.config.routing.stride_tokens, seed)
        self.hot_prefixes.record(hashes, prompt)  # for the dashboard: one dict update
        return RoutingRequest(api.new_id("route"), len(prompt), hashes, tenant=tenant)

    async def admit(self) -> list[ReplicaState]:
        """The replicas with a free slot, once this request's turn has come; raises
        :class:`~router.admission.Overloaded` when the queue is full or too slow."""
        if not len(self.admission):
            states = self.available()
            if states:
                return states
        deadline = self.admission.deadline()
        while True:  # woken when a slot frees; another request may have taken it
            await self.admission.wait_turn(deadline)
            states = self.available()
            if states:
                return states

    def available(self) -> list[ReplicaState]:
        """Healthy replicas below their cap of requests in flight."""
        limit = self.config.max_outstanding_per_replica
        return [s for s in self.pool.states if s.outstanding_requests < limit]

    def stats(self) -> GatewayStats:
        return self.accounting.stats(self.policy.name, self.config, self.pool, self.admission)
