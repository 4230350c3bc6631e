"""A fleet that grows and shrinks as router/fleet/autoscaler.py says.

It starts at ``replicas``. Every ``interval_s`` while there is work, the autoscaler looks
at the load in the engines and the routers' queues; a replica asked for serves
``replica_startup_s`` later, empty; a stopped one leaves routing at once and stops once
its requests have ended, so no request fails. A disaggregated fleet scales each pool
(prefill, decode) apart, on its own replicas' load and signal, within the bounds; the
requests waiting in the routers count for every pool (each needs both). A fixed fleet
only counts its size.
"""

from __future__ import annotations

from collections import Counter

import numpy as np

from loadtest.replay.config import ReplayConfig
from loadtest.replay.engines import EngineSteps
from loadtest.replay.events import EventQueue
from loadtest.replay.routers import Routers
from replica.engine import Engine
from router.fleet.autoscaler import Autoscaler, FleetLoad, to_stop


class Scaling:
    """The replicas routed to, those asked for and not yet serving, those stopping,
    and the fleet's history: its size (replicas held: serving, starting or stopping)
    from each time on, each pool's of a disaggregated fleet (``pool_sizes``), and when
    each replica was asked for, began serving, left routing and stopped
    (``scale_events``)."""

    def __init__(
        self, config: ReplayConfig, events: EventQueue, engines: EngineSteps, routers: Routers
    ) -> None:
        self._config, self._events = config, events
        self._engines, self._routers = engines, routers
        self.routable = list(range(config.replicas))
        #: Each replica's role, by index: those asked for later too.
        self.roles = list(config.roles)
        #: (when it serves, index): replicas asked for, in the order they will serve.
        self._starting: list[tuple[float, int]] = []
        self._stopping: set[int] = set()
        self.fleet_sizes: list[tuple[float, int]] = [(0.0, config.replicas)]
        split = config.prefill or config.decode
        self.pool_sizes = {r: [(0.0, n)] for r, n in Counter(self.roles).items()} if split else {}
        self.scale_events: list[tuple[float, str, int]] = []
        scaling, clock = config.autoscale, events.clock
        pools = dict.fromkeys(self.roles)
        self._pools = {} if scaling.fixed else {r: Autoscaler(scaling, clock, r) for r in pools}
        if self._pools:
            events.next_tick = 0.0
        self._rng = np.random.default_rng([config.seed, 2])

    def routed_to(self) -> list[int] | None:
        """The replicas routed to, if the fleet scales (``None``: a fixed fleet, all)."""
        return self.routable if self._pools else None

    def tick(self) -> None:
        """Admit the replicas that have started, and grow or shrink each pool as its
        autoscaler says; look again ``interval_s`` later."""
        assert self._pools
        now = self._events.now
        self._events.next_tick = now + self._config.autoscale.interval_s
        while self._starting and self._starting[0][0] <= now:
            _, index = self._starting.pop(0)
            self.routable.append(index)
            self._routers.route_to(index)
            self.scale_events.append((now, "serving", index))
        for role, autoscaler in self._pools.items():
            self._scale(role, autoscaler)
        self._note_fleet_size()

    def _scale(self, role: str, autoscaler: Autoscaler) -> None:
        """Grow or shrink the pool of ``role`` to the size its autoscaler wants."""
        now = self._events.now
        routable = [i for i in self.routable if self.roles[i] == role]
        starting = [entry for entry in self._starting if self.roles[entry[1]] == role]
        serving = len(routable) + len(starting)
        wanted = autoscaler.decide(serving, self._pool_load(role))
        for _ in range(wanted - serving):
            index = self._add_replica(role)
            self._starting.append((now + self._config.replica_startup_s, index))
            self.scale_events.append((now, "asked", index))
        for _ in range(serving - wanted):
            if starting:  # not serving yet: nothing to lose
                self._starting.remove(starting.pop())
            elif len(routable) > 1:
                self._stop(self._to_stop(routable))

    def engine_idle(self, index: int) -> None:
        """Engine ``index`` has stepped: a stopping replica with no request left stops."""
        if index in self._stopping and not self._engines[index].has_unfinished:
            self._stopped(index)

    def _pool_load(self, role: str) -> FleetLoad:
        held = [*self.routable, *self._stopping]
        engines = [self._engines[i] for i in held if self.roles[i] == role]
        waiting = self._routers.waiting()
        return FleetLoad(
            sum(e.num_running + e.num_waiting for e in engines) + len(waiting),
            sum(e.queued_prefill_tokens for e in engines)
            + sum(w.routing.num_prompt_tokens for w in waiting),
        )

    def _add_replica(self, role: str) -> int:
        """A new engine, empty, known to every router but not routed to until it
        serves; returns its index (the one it keeps)."""
        index = self._engines.add(Engine(self._config.engine_config(self._config.model)))
        self._routers.add_replica(index, self._engines[index], role)
        self.roles.append(role)
        return index

    def _to_stop(self, pool: list[int]) -> int:
        """The replica of ``pool`` to stop, as ``scale_in`` chooses (router/fleet/autoscaler.py)."""
        first = self._routers[0]
        states = [first.states[i] for i in pool]
        ids = [state.replica_id for state in states]
        load_of = {state.replica_id: state.outstanding_requests for state in states}
        policy = first.routes.policy()
        scale_in = self._config.autoscale.scale_in
        chosen = to_stop(scale_in, ids, load_of, policy.cache_value, self._rng)
        return pool[ids.index(chosen)]

    def _stop(self, index: int) -> None:
        """Route nothing more to replica ``index``; it stops once its requests end."""
        self.routable.remove(index)
        self._stopping.add(index)
        self.scale_events.append((self._events.now, "stopping", index))
        if not self._engines[index].has_unfinished:
            self._stopped(index)

    def _stopped(self, index: int) -> None:
        self._stopping.discard(index)
        self.scale_events.append((self._events.now, "stopped", index))
        self._routers.remove_replica(index)
        self._note_fleet_size()

    def _note_fleet_size(self) -> None:
        held = [*self.routable, *(i for _, i in self._starting), *self._stopping]
        _note(self.fleet_sizes, self._events.now, len(held))
        counts = Counter(self.roles[i] for i in held)
        for role, sizes in self.pool_sizes.items():
            _note(sizes, self._events.now, counts[role])


def _note(sizes: list[tuple[float, int]], now: float, size: int) -> None:
    """``size`` from ``now`` on, if it changed."""
    if size != sizes[-1][1]:
        sizes.append((now, size))
