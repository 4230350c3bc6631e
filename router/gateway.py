"""One gateway: its parts, and the request path composed from its stages.

A completion request walks the stages of ``router/path/`` once each, in one
direction; each takes the value the stage before returned and returns the next, and
none calls back into the gateway:

    ApiKeys         the tenant of its key (401 before any work without one)   -> Tenant
    envelope.read   the body (413 over the limits), its prompt tokenized     -> Envelope
    Resolver        salt, class, model, session, the prompt's keys           -> Ticket
    Admitter        a slot on a replica of its model, or its turn in the queue -> replicas
    Placer          the policy's choice within the tenant's budget, recorded  -> Placement
    Dispatcher      upstream, the answer relayed; settled when it ends       -> Response
    Settlement      (called by the dispatcher) load, counters, tenant service

:meth:`Gateway.handle` composes them, and places a request again on another replica
while a failed try has sent the client nothing. The gateway also owns what the
stages share: a tokenizer per model (``router/fleet/tokenizers.py``), the prefix keys,
one policy per model (``router/fleet/models.py``), the backends, the fair queue and the
counters.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace

import aiohttp
import numpy as np
from fastapi.responses import Response

from replica.api.fleet_token import bearer
from replica.api.model_tokenizer import HFTokenizer, load_tokenizer
from replica.api.tokenizer import Tokenizer
from router.config import DEFAULT_MAX_PROMPT_TOKENS, GatewayConfig
from router.core import ReplicaState
from router.fair.admission import AdmissionQueue, Overloaded
from router.fair.fairness import FairShare
from router.fair.slots import engine_has_room
from router.fair.tenants import ApiKeys, SaltBook
from router.fleet.backend_check import BackendCheck
from router.fleet.backends import BackendPool
from router.fleet.http_client import Client, Timeouts
from router.fleet.models import ModelRoutes
from router.fleet.tokenizers import ModelTokenizers
from router.index.hot_prefixes import HotPrefixes
from router.index.key_cache import PrefixKeyCache
from router.path import envelope
from router.path.accounting import Accounting
from router.path.admit import Admitter
from router.path.dispatch import Dispatcher, UpstreamFailed, error_response
from router.path.place import Placer
from router.path.resolve import Resolver, Ticket
from router.path.settle import Settlement
from router.policies import Policy, make_policy
from router.stats import GatewayStats, HotSetStats


class NoBackends(Exception):
    """The gateway has no backend to route to (503)."""


class Gateway:
    """One gateway's routing state and its request path. ``client``: the pooled session
    for the backends' health, statistics and events; ``upstream``: the request path's
    kept-alive client (by default, one with the config's timeouts, carrying
    ``fleet_token``, that replicas ask of their callers: replica/api/fleet_token.py)."""

    def __init__(
        self,
        config: GatewayConfig,
        client: aiohttp.ClientSession,
        keys: ApiKeys | None = None,
        upstream: Client | None = None,
        secret: bytes = b"",
        fleet_token: str = "",
    ) -> None:
        self.config = config
        #: The fleet's secret that tenants' salts are keyed with (router/fair/tenants.py).
        self.secret = secret
        self.tokenizers = self._tokenizers(config)
        routing = config.routing
        self.prefix_keys = PrefixKeyCache(
            routing.block_size, routing.index.stride, config.key_cache_tokens
        )
        self.rng = np.random.default_rng(config.seed)
        self.policy_name = config.policy
        self.models = ModelRoutes(self._policy_for, config.model)
        self.pool = self._pool(client)
        fair = FairShare(config.fairness, config.fair_half_life_s)
        self.queue = AdmissionQueue(config.max_queued, config.queue_timeout_s, fair)
        self.accounting = Accounting(routing.stride_tokens, block_tokens=routing.block_size)
        self.salts = SaltBook()
        board = config.dashboard
        self.hot_prefixes = HotPrefixes(
            board.hot_prefixes_kept, board.hot_prefix_half_life, board.hot_prefix_sample_tokens
        )
        # The request path's stages, in the order a request walks them.
        self.keys = keys or ApiKeys({})
        # the fleet's token on every request: replicas answer only their fleet
        self.upstream = upstream or Client(timeouts(config), bearer(fleet_token))
        self.settlement = Settlement(self.accounting, self.queue)
        self.resolver, self.admitter, self.placer, self.dispatcher = self._stages(fair)

    @staticmethod
    def _tokenizers(config: GatewayConfig) -> ModelTokenizers:
        """The gateway's own tokenizer (with ``--chat-template``), the ones named per
        model, and those its replicas' cards will name."""
        cache_tokens = config.tokenizer_cache_tokens
        own = load_tokenizer(config.tokenizer, config.chat_template, cache_tokens)
        return ModelTokenizers(
            own,
            config.tokenizer,
            config.model,
            config.named_tokenizers(),
            lambda name: load_tokenizer(name, cache_tokens=cache_tokens),
        )

    def tokenizer_of(self, name: object) -> Tokenizer:
        """The tokenizer of the model (or adapter's base model) a request names."""
        if not self.tokenizers.several:  # one for every model: no name to resolve
            return self.tokenizers.default
        served = self.models.resolve(name) if isinstance(name, str) else None
        return self.tokenizers.of(served.model if served else None)

    def _pool(self, client: aiohttp.ClientSession) -> BackendPool:
        """The backends, each checked as it joins (unless told not to), their events and
        joins and leaves told to the models' policies."""
        config, routing = self.config, self.config.routing
        check = BackendCheck(
            client, self.tokenizers, config.model, routing.block_size, routing.index.stride
        )
        return BackendPool(
            client,
            on_events=self.models.events,
            on_added=self._added,
            on_removed=self.models.removed,
            poll_interval_s=config.kv_events_interval_s,
            default_capacity_blocks=config.capacity_blocks,
            check=check if config.check_backends else None,
            describe_interval_s=config.describe_interval_s,
            on_report=self._reported,
        )

    def _stages(self, fair: FairShare) -> tuple[Resolver, Admitter, Placer, Dispatcher]:
        """The stages after the envelope, each given the parts it uses and no more."""
        config, models, pool, accounting = self.config, self.models, self.pool, self.accounting
        resolver = Resolver(
            config, models, self.prefix_keys, self.hot_prefixes, self.salts, accounting, self.secret
        )
        admitter = Admitter(config, self.queue, pool, models)
        placer = Placer(models, pool, self.salts, accounting, fair)
        dispatcher = Dispatcher(self.upstream, pool, self.settlement)
        return resolver, admitter, placer, dispatcher

    async def handle(self, request: envelope.Inbound, path: str, chat: bool) -> Response:
        """One completion request, through the stages (see the module's doc)."""
        try:
            ticket, candidates = await self.admitted(request, path, chat)
        except NoBackends as error:
            return error_response(str(error), 503)
        except Overloaded as error:
            headers = {"retry-after": str(error.retry_after_s)}
            return error_response(str(error), 429, headers)
        return await self._with_retries(ticket, candidates)

    async def admitted(
        self, request: envelope.Inbound, path: str, chat: bool
    ) -> tuple[Ticket, list[ReplicaState]]:
        """The stages before placement: the request's ticket and the replicas with a slot
        for it. Raises ``Unauthorized`` (401), ``api.Rejected`` (413, 400, 404),
        :class:`NoBackends` (503) and ``Overloaded`` (429). A router that sends the
        request itself (Ray Serve's: deploy/ray_serve/) places it next with
        ``placer.place`` and settles it with ``settlement.ended``."""
        tenant = self.keys.tenant(request.headers.get("authorization"))  # 401 before any work
        name = tenant.name if tenant else None
        limit = self.config.max_prompt_tokens or self.pool.max_model_len
        limits = envelope.Limits(self.config.max_request_bytes, limit or DEFAULT_MAX_PROMPT_TOKENS)
        read = await envelope.read(request, path, chat, limits, self.tokenizer_of, name)
        ticket = self.resolver.resolve(read, tenant)
        if not self.pool.backends:
            raise NoBackends("no backends to route to")
        candidates = await self.admitter.admit(ticket.request)
        self.accounting.overhead.observe(time.perf_counter() - read.received)
        return ticket, candidates

    async def _with_retries(self, ticket: Ticket, candidates: list[ReplicaState]) -> Response:
        """Place and send; after a failed try, place again among the replicas not
        tried yet, at most ``max_retries`` times."""
        request, tried = ticket.request, set[str]()
        failure = UpstreamFailed("every replica is down")
        max_retries = self.config.max_retries
        for attempt in range(max_retries + 1):
            candidates = [s for s in candidates if s.replica_id not in tried]
            if not candidates:
                break
            placement = self.placer.place(request, candidates)
            tried.add(placement.backend.state.replica_id)
            try:
                return await self.dispatcher.send(ticket, placement)
            except UpstreamFailed as error:
                failure = error
            if attempt < max_retries:
                self.accounting.retries += 1
                await self._backoff(attempt)
                candidates = self.admitter.after_failure(request)
        return error_response(f"no replica could serve the request: {failure}", 502)

    async def _backoff(self, attempt: int) -> None:
        jitter = 0.5 + self.rng.random()
        await asyncio.sleep(self.config.retry_backoff_s * 2**attempt * jitter)

    def _policy_for(self, model: str) -> Policy:
        routing = replace(self.config.routing, model=model)  # it seeds the model's index
        return make_policy(self.policy_name, time.monotonic, self.rng, routing)

    def switch_policy(self, name: str) -> None:
        """Route with ``name`` from now on; the new policies learn the fleet afresh."""
        make_policy(name, time.monotonic, self.rng, self.config.routing)  # refused here if bad
        self.policy_name = name
        self.models.switch(self._policy_for)

    def _added(self, state: ReplicaState) -> None:
        self.models.added(state)
        self.queue.slot_freed()  # requests for its model may be waiting for it

    def _reported(self, state: ReplicaState) -> None:
        """A load report: where it gives a tenant beyond its share room again (its
        engine's queue shrank below the bound), a waiting request may now take it."""
        bound, reserve = self.config.max_engine_waiting, self.config.fair_reserve_per_replica
        if bound and len(self.queue) and engine_has_room(state, bound, reserve):
            self.queue.slot_freed()  # (without the bound, only a request's end frees a slot)

    def tenant_footprint(self) -> dict[str, dict[str, int]]:
        """Each tenant's blocks on each replica's GPU (by replica id), as the precise
        indexes know them from the replicas' events."""
        footprint: dict[str, dict[str, int]] = {}
        indexes = (policy.prefix_index() for policy in self.models.policies.values())
        for index in (index for index in indexes if index is not None):
            for replica_id in index.replicas:
                for salt, blocks in index.gpu_blocks_by_salt(replica_id).items():
                    tenant = self.salts.tenant_of(salt)
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
            for hot in policy.hot_sets()
        ]
        return sorted(sets, key=lambda s: -s.share)

    def stats(self) -> GatewayStats:
        stats = self.accounting.stats(
            self.policy_name, self.config, self.pool, self.queue, self.tenant_footprint()
        )
        stats = replace(stats, key_cache=self.prefix_keys.stats(), hot_sets=self.hot_sets())
        own = self.tokenizers.default  # (another model's: not shown)
        if isinstance(own, HFTokenizer) and own.pieces is not None:
            return replace(stats, tokenizer_cache=own.pieces.stats())
        return stats


def timeouts(config: GatewayConfig) -> Timeouts:
    """The request path's timeouts (see ``router/fleet/http_client.py``)."""
    return Timeouts(
        config.upstream_connect_timeout_s,
        config.upstream_read_timeout_s,
        config.upstream_timeout_s,
    )
