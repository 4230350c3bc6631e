"""The routers' view of the simulated fleet, and a request routed through one.

With ``routers`` G > 1 the requests are spread at random over G routers, each with its
own policies, index and load view, as G gateways are: each hears the engines' KV events
and their load reports (one after every engine step, as a replica publishes its load
on change) ``event_delay_s`` after they happen, and counts its own dispatches since the
last report (``router.fleet.load.reported``). One router counts its own load, and is
told each engine's free blocks at once.

A request's way through its router is a gateway's: the policy of the model it names
chooses among the replicas that serve it (within its tenant's cache budget, and, with
``max_outstanding``, among those with a slot free for it: router/fair/slots.py); load is
counted at dispatch and released at the end.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, replace
from functools import lru_cache

import numpy as np

from loadtest.replay.config import ReplayConfig
from loadtest.replay.events import Delivery, EventQueue
from loadtest.replay.request import TurnRequest
from loadtest.workloads import Session
from replica.api.identity import affinity_key, identity_seed, prefix_keys
from replica.api.kv_events import KVEvent
from replica.api.stats import LoadReport
from replica.engine import Engine, RequestOutput
from router.core import ReplicaState, RoutingRequest
from router.fair.cache_budget import within_budget
from router.fair.fairness import FairQueue, FairShare
from router.fair.slots import with_free_slot
from router.fleet import load
from router.fleet.models import ModelRoutes, ServedName
from router.policies import Policy, make_policy


@dataclass
class Router:
    """One router, as one gateway: its policies (one per model), its view of every
    replica (by the engine's index), and its fair share and queue of waiting requests."""

    routes: ModelRoutes
    states: list[ReplicaState]
    fair_share: FairShare
    queue: FairQueue[TurnRequest]

    def policy(self, request: TurnRequest) -> Policy:
        return self.routes.policy(request.routing.model)


class Routers:
    """The G routers in front of the engines (``routers[0]``, the only one by default)."""

    def __init__(
        self,
        config: ReplayConfig,
        policy: str,
        engines: list[Engine],
        events: EventQueue,
        adapters: bool = False,
    ) -> None:
        """``adapters``: whether the routers are told which adapters each engine holds
        in its slots (a workload that asks for some)."""
        self._config = config
        self._events = events
        self.routers = [self._router(policy, g, engines) for g in range(config.routers)]
        for router in self.routers:
            for state, engine in zip(router.states, engines, strict=True):
                state.free_blocks = engine.free_blocks
        self._adapters = adapters
        self._pick_router = np.random.default_rng([config.seed, 1])
        self._seeds = lru_cache(maxsize=None)(identity_seed)  # (name, salt): a bounded set
        self._budgets = config.tenant_budgets

    def __getitem__(self, index: int) -> Router:
        return self.routers[index]

    def __iter__(self) -> Iterator[Router]:
        return iter(self.routers)

    def _router(self, policy: str, index: int, engines: list[Engine]) -> Router:
        """Router ``index``, its policies seeded apart from the other routers'."""
        config, clock = self._config, self._events.clock
        rng = np.random.default_rng(config.seed if index == 0 else [config.seed, 0, index])
        routes = ModelRoutes(
            lambda model: make_policy(policy, clock, rng, replace(config.routing, model=model)),
            config.replica_models[0] if config.fleet else config.model,
        )
        states = [
            ReplicaState(
                f"replica-{i}",
                config.capacity_blocks or 0,
                model=engine.config.model,
                adapters=frozenset(engine.config.lora_modules),
            )
            for i, engine in enumerate(engines)
        ]
        for state in states:
            routes.added(state)
        fair_share = FairShare(config.fairness, config.fair_half_life_s, clock=clock)
        return Router(routes, states, fair_share, FairQueue(fair_share))

    # ---------------------------------------------------------------- requests

    def request(
        self, session: Session, session_index: int, turn: int, prompt: np.ndarray
    ) -> TurnRequest:
        """A turn's request as it reaches a router (one at random of several), with the
        keys the router routes by: its prompt's, and its session's if clients send it."""
        config = self._config
        block_size, stride = config.routing.block_size, config.routing.index.stride
        routers = len(self.routers)
        router = int(self._pick_router.integers(routers)) if routers > 1 else 0
        routes = self.routers[router].routes
        served = ServedName(session.model or routes.default_model, session.adapter)
        seed = self._seeds(served.name, session.cache_salt)
        routing = RoutingRequest(
            f"{session.session_id}/{turn}",
            len(prompt),
            prefix_keys(prompt, block_size, stride, seed),
            session=session.session_id if config.session_keys else None,
            model=served.model,
            adapter=served.adapter,
            tenant=session.tenant,
            priority=session.priority,
            cache_budget=self._budgets.get(session.tenant or ""),
            affinity=affinity_key(prompt, block_size, stride, seed),
        )
        return TurnRequest(session_index, turn, routing, prompt, self._events.now, router)

    def serving(self, request: TurnRequest, routable: list[int] | None) -> list[ReplicaState]:
        """The replicas that serve ``request``'s model: of a scaling fleet, those
        ``routable``; of a fleet of several models, those of its model (and adapter)."""
        router = self.routers[request.router]
        if routable is not None:
            return [router.states[i] for i in routable]
        if not self._config.fleet:
            return router.states
        routing = request.routing
        served = ServedName(routing.model or router.routes.default_model, routing.adapter)
        return router.routes.serving(served, router.states)

    def wait(self, request: TurnRequest) -> None:
        """Queue ``request`` at its router, until a replica has a slot free for it."""
        routing = request.routing
        self.routers[request.router].queue.push(request, routing.tenant, routing.priority)

    def admitted(
        self, router_index: int, routable: list[int] | None
    ) -> Iterator[tuple[TurnRequest, list[ReplicaState]]]:
        """From the router's queue, the next in line while a replica that serves it has
        a slot free (as slots free at a gateway), with those replicas."""
        queue = self.routers[router_index].queue
        can_serve = lambda request: bool(self._free(request, routable))  # noqa: E731
        while (request := queue.pop(can_serve)) is not None:
            yield request, self._free(request, routable)

    def _free(self, request: TurnRequest, routable: list[int] | None) -> list[ReplicaState]:
        """The replicas that serve ``request`` with a slot free for it."""
        config, router = self._config, self.routers[request.router]
        policy = router.policy(request)
        return with_free_slot(
            request.routing,
            self.serving(request, routable),
            router.fair_share,
            config.max_outstanding,
            config.fair_reserve_per_replica,
            lambda: policy.holders(request.routing),
        )

    def choose(self, request: TurnRequest, candidates: list[ReplicaState], salt: str | None) -> int:
        """The engine the policy sends ``request`` to, among ``candidates`` (those
        within its tenant's cache budget, if any is)."""
        router = self.routers[request.router]
        policy = router.policy(request)
        allowed = within_budget(policy, request.routing, candidates, (salt,))
        return router.states.index(policy.choose(request.routing, allowed))

    # ------------------------------------------------------------------- load

    def dispatched(self, request: TurnRequest, index: int) -> None:
        router = self.routers[request.router]
        replica = router.states[index]
        load.dispatched(router.policy(request), request.routing, replica, now=self._events.now)
        router.fair_share.dispatched(request.routing)

    def prefilled(self, request: TurnRequest, index: int) -> None:
        load.prefilled(request.routing, self.routers[request.router].states[index])

    def completed(self, request: TurnRequest, index: int, output: RequestOutput) -> None:
        router = self.routers[request.router]
        cached = output.num_cached_tokens
        load.completed(router.policy(request), request.routing, router.states[index], cached)
        router.fair_share.ended(request.routing, cached, output.num_output_tokens)

    def waiting(self) -> list[TurnRequest]:
        """The requests waiting in every router's queue."""
        return [request for router in self.routers for request in router.queue]

    # ------------------------------------------------- what the engines publish

    def publish(self, index: int, engine: Engine, events: list[KVEvent]) -> None:
        """Engine ``index``'s new KV events and, after its step, its load."""
        if events:
            self._send(index, events)
        if len(self.routers) > 1:  # a replica publishes its load on change
            self._send(index, self._load_report(engine))
            return
        state = self.routers[0].states[index]  # told at once
        state.free_blocks = engine.free_blocks
        if self._adapters:
            state.loaded_adapters = engine.adapters.resident
            state.free_adapter_slots = engine.adapters.free_slots

    def _load_report(self, engine: Engine) -> LoadReport:
        adapters = self._adapters
        return LoadReport(
            engine.num_running,
            engine.num_waiting,
            engine.queued_prefill_tokens,
            ts=self._events.now,
            free_blocks=engine.free_blocks,
            adapters=engine.adapters.resident if adapters else None,
            free_adapter_slots=engine.adapters.free_slots if adapters else None,
        )

    def _send(self, index: int, payload: list[KVEvent] | LoadReport) -> None:
        """To every router, after the delay."""
        delay = self._config.event_delay_s
        if not delay:
            self.deliver(index, payload)
        else:
            self._events.schedule(self._events.now + delay, Delivery(index, payload))

    def deliver(self, index: int, payload: list[KVEvent] | LoadReport) -> None:
        for router in self.routers:
            if isinstance(payload, LoadReport):
                load.reported(router.states[index], payload)
            else:
                router.routes.events(router.states[index], payload)

    # ------------------------------------------------------ replicas come and go

    def add_replica(self, index: int, engine: Engine) -> None:
        """A new engine, empty, in every router's fleet."""
        config = self._config
        for router in self.routers:
            state = ReplicaState(
                f"replica-{index}", config.capacity_blocks or 0, model=config.model
            )
            state.free_blocks = engine.free_blocks
            router.states.append(state)
            router.routes.added(state)

    def remove_replica(self, index: int) -> None:
        for router in self.routers:
            router.routes.removed(router.states[index])

    def dispatched_per_replica(self) -> list[int]:
        """Requests dispatched to each replica, by all the routers."""
        per_router = [[state.dispatched for state in router.states] for router in self.routers]
        return [sum(counts) for counts in zip(*per_router, strict=True)]
