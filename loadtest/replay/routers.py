"""The routers in front of the simulated engines, and a request as it reaches one.

With ``routers`` G > 1 the requests are spread at random over G routers, each with its
own policies, index and load view, as G gateways are (a request's way through one:
routing.py; what they hear from the engines: reports.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from functools import lru_cache

import numpy as np

from loadtest.replay.config import ReplayConfig
from loadtest.replay.events import EventQueue
from loadtest.replay.request import TurnRequest
from loadtest.replay.routing import Router
from loadtest.workloads import Session
from replica.api.identity import affinity_key, identity_seed, prefix_keys
from replica.engine import Engine
from router.core import ReplicaState, RoutingRequest
from router.fleet.models import ModelRoutes, ServedName
from router.policies import make_policy


class Routers:
    """The G routers in front of the engines (``routers[0]``, the only one by default)."""

    def __init__(
        self,
        config: ReplayConfig,
        policy: str,
        engines: list[Engine],
        events: EventQueue,
    ) -> None:
        self._config = config
        self._events = events
        self.routers = [self._router(policy, g, engines) for g in range(config.routers)]
        for router in self.routers:
            for state, engine in zip(router.states, engines, strict=True):
                state.free_blocks = engine.free_blocks
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
                role=role,
                max_num_seqs=config.max_num_seqs,  # as a live replica's card says
            )
            for i, (engine, role) in enumerate(zip(engines, config.roles, strict=True))
        ]
        for state in states:
            routes.added(state)
        return Router(routes, states, config, clock)

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

    def waiting(self) -> list[TurnRequest]:
        """The requests waiting in every router's queue."""
        return [request for router in self.routers for request in router.queue]

    def add_replica(self, index: int, engine: Engine, role: str = "both") -> None:
        """A new engine, empty, in every router's fleet, not routed to until
        :meth:`route_to`."""
        config = self._config
        for router in self.routers:
            state = ReplicaState(
                f"replica-{index}",
                config.capacity_blocks or 0,
                model=config.model,
                role=role,
                max_num_seqs=config.max_num_seqs,
            )
            state.free_blocks = engine.free_blocks
            router.states.append(state)

    def route_to(self, index: int) -> None:
        """Replica ``index`` serves: every router's policy may choose it."""
        for router in self.routers:
            router.routes.added(router.states[index])

    def remove_replica(self, index: int) -> None:
        for router in self.routers:
            router.routes.removed(router.states[index])

    def dispatched_per_replica(self) -> list[int]:
        """Requests dispatched to each replica, by all the routers."""
        per_router = [[state.dispatched for state in router.states] for router in self.routers]
        return [sum(counts) for counts in zip(*per_router, strict=True)]
