"""prefix-router's policies as a Ray Serve request router.

Ray Serve runs a request router in every handle and proxy that calls a deployment
(``RequestRouterConfig(request_router_class=...)``) and asks it, request by request,
to rank the deployment's replicas (``choose_replicas``). This one ranks them as our
gateway would route them, because it *is* our gateway's request path without its HTTP
ends: each router holds a :class:`~router.gateway.Gateway` whose backends are the
deployment's replicas (their own servers' URLs, which each replica says once in
``record_replica_metadata``), so it reads their cards, checks them, follows their KV
events and load reports, tokenizes and keys the prompt, admits and places it exactly
as the gateway does. Serve then sends the request to the chosen replica over its own
channel, and tells the router when it ends (``on_request_completed``), which settles
its load.

Several routers (one per ingress replica, per proxy) keep one index each, fed by the
same KV events: they agree on what each replica holds, as several gateways do. A
replica that Serve adds joins the pool at the next decision; one it removes is
forgotten.

What differs from the gateway: the router does not see the answer, so it learns the
cached tokens from the KV events alone (no correction from ``usage``), and a request's
prefill load is released when it ends rather than at its first token.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, fields
from typing import Any, TypeVar

import aiohttp
from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from deploy.flags import with_overrides
from deploy.ray_serve import registry
from deploy.ray_serve.calls import CompletionCall
from replica.api import openai as api
from replica.api import stats as stats_codec
from replica.api.card import EngineCard
from replica.api.fleet_token import fleet_token
from replica.api.stats import KVEventsEndpoint
from router.config import GatewayConfig
from router.core import RoutingRequest
from router.fair.admission import Overloaded
from router.fair.tenants import Unauthorized
from router.fleet.backends import describe
from router.gateway import Gateway, NoBackends
from router.http.app import backend_session
from router.http.dashboard.history import History
from router.http.dashboard.view import build, replica_figures
from router.path.place import Placement

log = logging.getLogger(__name__)
T = TypeVar("T")

#: How long the first decision waits for the replicas to say what they are.
JOIN_TIMEOUT_S = 30.0


@dataclass
class _Placed:
    request: RoutingRequest
    placement: Placement


class PrefixRequestRouter(RequestRouter):
    """Ranks a deployment's replicas with a prefix-router policy (``cache_aware`` by
    default). ``request_router_kwargs``: ``policy`` and any other field of
    :class:`~router.config.GatewayConfig` by name."""

    def initialize_state(self, policy: str = "cache_aware", **config: Any) -> None:
        unknown = sorted(set(config) - {f.name for f in fields(GatewayConfig)})
        if unknown:
            raise ValueError(f"unknown request_router_kwargs: {', '.join(unknown)}")
        # nested settings as the config file spells them: routing: {cache_aware: {...}}
        self.config = with_overrides(GatewayConfig(policy=policy), config)
        #: What the kwargs set, kept when the replicas say otherwise (``_ready``).
        self._said = set(config) | set(config.get("routing", {}))
        self.gateway: Gateway | None = None
        self._starting = asyncio.Lock()
        #: Placed and not ended, by Serve's internal request id.
        self._placed: dict[str, _Placed] = {}
        #: The dashboard's charts over time, as the gateway's app keeps them.
        self.history = History(self.config.dashboard)
        registry.LIVE_ROUTERS[self._deployment_id.name] = self

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        handed = pending_request.args[0] if pending_request and pending_request.args else None
        call = CompletionCall.read(handed)
        if call is None or not candidate_replicas:
            return [candidate_replicas]  # nothing to route by: Serve's choice among them
        assert pending_request is not None
        gateway = await self._ready()
        request_id = pending_request.metadata.internal_request_id
        self._settle(request_id)  # chosen before, not taken (that replica was full)
        try:
            ticket, admitted = await gateway.admitted(call, call.path, call.chat)
        except (api.Rejected, Unauthorized, Overloaded, NoBackends):
            return [candidate_replicas]  # the replica answers it as it would alone
        by_id = {replica.replica_id.to_full_id_str(): replica for replica in candidate_replicas}
        states = [state for state in admitted if state.replica_id in by_id]
        if not states:
            return [candidate_replicas]
        placement = gateway.placer.place(ticket.request, states)
        self._placed[request_id] = _Placed(ticket.request, placement)
        # the client gone while Serve sends it: settled, as it will never end
        pending_request.future.add_done_callback(
            lambda routed: self._settle(request_id) if routed.cancelled() else None
        )
        return [[by_id[placement.backend.state.replica_id]]]

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        placed = self._placed.get(internal_request_id)
        if placed is not None and placed.placement.backend.state.replica_id == (
            replica_id.to_full_id_str()
        ):
            self._settle(internal_request_id)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        if self.gateway is not None:
            self._follow(self.gateway)

    async def stats(self) -> dict[str, Any]:
        """The gateway's ``/stats``, read on this router's loop (from any other)."""
        return await self._on_own_loop(self._stats)

    async def dashboard_view(self, since: float, show_text: bool) -> dict[str, Any]:
        """One refresh of the gateway's dashboard (``/dashboard/data``), made on this
        router's loop, where the pool's session lives."""
        return await self._on_own_loop(lambda: self._dashboard_view(since, show_text))

    async def _stats(self) -> dict[str, Any]:
        assert self.gateway is not None
        encoded: dict[str, Any] = stats_codec.encode(self.gateway.stats())
        return encoded

    async def _dashboard_view(self, since: float, show_text: bool) -> dict[str, Any]:
        gateway, board = self.gateway, self.config.dashboard
        assert gateway is not None
        replicas = await replica_figures(gateway, board.dashboard_replica_timeout_s)
        shown = board.hot_prefixes_shown
        view = build(gateway, self.history, replicas, time.time(), since, show_text, shown)
        return dataclasses.asdict(view)

    async def _on_own_loop(self, work: Callable[[], Coroutine[Any, Any, T]]) -> T:
        """Await ``work()`` run on this router's event loop: Serve runs routers on a loop
        of their own, and the gateway's session and tasks belong to it."""
        future: concurrent.futures.Future[T] = asyncio.run_coroutine_threadsafe(
            work(), self._event_loop
        )
        return await asyncio.wrap_future(future)

    def _settle(self, request_id: str) -> None:
        placed = self._placed.pop(request_id, None)
        if placed is not None and self.gateway is not None:
            self.gateway.settlement.ended(placed.request, placed.placement, None, failed=False)

    async def _ready(self) -> Gateway:
        """The gateway, made on the first decision (on Serve's event loop, where its
        pool's tasks then run), with the replicas joined."""
        async with self._starting:
            if self.gateway is None:
                token = fleet_token(self.config.fleet_token_file)
                client = backend_session(self.config, token)
                card = await self._first_card(client)
                if card is not None:  # the model, tokenizer, block size the engines say
                    self.config = self.config.configured_by(card, keep=self._said)
                gateway = Gateway(self.config, client, fleet_token=token)
                self._follow(gateway)
                await gateway.pool.learned(JOIN_TIMEOUT_S)
                self.gateway = gateway
            return self.gateway

    async def _first_card(self, client: aiohttp.ClientSession) -> EngineCard | None:
        """What the first replica that answers says of itself (``None``: none does)."""
        for replica in self._replicas_list:
            url = replica.replica_metadata.get("url")
            card = await describe(client, url) if url else None
            if card is not None:
                return card
        return None

    def _follow(self, gateway: Gateway) -> None:
        """Make the pool's backends the deployment's replicas."""
        pool = gateway.pool
        current = {
            replica.replica_id.to_full_id_str(): replica.replica_metadata
            for replica in self._replicas_list
        }
        for replica_id, said in current.items():
            url = said.get("url")
            if url and replica_id not in {b.state.replica_id for b in pool.backends}:
                pool.add(url, replica_id=replica_id, kv_endpoint=_kv_endpoint(said))
        for backend in pool.backends:
            if backend.state.replica_id not in current:
                self._event_loop.create_task(self._forget(gateway, backend.state.replica_id))

    @staticmethod
    async def _forget(gateway: Gateway, replica_id: str) -> None:
        with contextlib.suppress(Exception):
            await gateway.pool.remove(replica_id)
        log.info("replica %s left the deployment: forgotten", replica_id)


def _kv_endpoint(said: dict[str, Any]) -> KVEventsEndpoint | None:
    """Where a replica that does not say it in its card publishes KV events: a Serve
    LLM replica (deploy/ray_serve/llm_server.py) says it in its metadata."""
    events = said.get("kv_events")
    return KVEventsEndpoint(**events) if events else None
