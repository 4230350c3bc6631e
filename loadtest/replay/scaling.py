"""A fleet that grows and shrinks as router/fleet/autoscaler.py says.

It starts at ``replicas``. Every ``interval_s`` while there is work, the autoscaler looks
at the load in the engines and the routers' queues; a replica asked for serves
``replica_startup_s`` later, empty; a stopped one leaves routing at once and stops once
its requests have ended, so no request fails. A fixed fleet only counts its size.
"""

from __future__ import annotations

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
    from each time on, and when each replica was asked for, began serving, left
    routing and stopped (``scale_events``)."""

    def __init__(
        self, config: ReplayConfig, events: EventQueue, engines: EngineSteps, routers: Routers
    ) -> None:
        self._config, self._events = config, events
        self._engines, self._routers = engines, routers
        self.routable = list(range(config.replicas))
        self._starting: list[float] = []  # when each replica asked for will serve
        self._stopping: set[int] = set()
        self.fleet_sizes: list[tuple[float, int]] = [(0.0, config.replicas)]
        self.scale_events: list[tuple[float, str, int]] = []
        scaling = config.autoscale
        self._autoscaler = None if scaling.fixed else Autoscaler(scaling, events.clock)
        if self._autoscaler is not None:
            events.next_tick = 0.0
        self._rng = np.random.default_rng([config.seed, 2])

    def routed_to(self) -> list[int] | None:
        """The replicas routed to, if the fleet scales (``None``: a fixed fleet, all)."""
        return None if self._autoscaler is None else self.routable

    def tick(self) -> None:
        """Admit the replicas that have started, and grow or shrink the fleet as the
        autoscaler says; look again ``interval_s`` later."""
        assert self._autoscaler is not None
        now = self._events.now
        self._events.next_tick = now + self._config.autoscale.interval_s
        while self._starting and self._starting[0] <= now:
            self._starting.pop(0)
            self.scale_events.append((now, "serving", self._add_replica()))
        serving = len(self.routable) + len(self._starting)
        wanted = self._autoscaler.decide(serving, self._fleet_load())
        for _ in range(wanted - serving):
            self._starting.append(now + self._config.replica_startup_s)
            asked = len(self._engines) + len(self._starting) - 1
            self.scale_events.append((now, "asked", asked))
        for _ in range(serving - wanted):
            if self._starting:  # not serving yet: nothing to lose
                self._starting.pop()
            elif len(self.routable) > 1:
                self._stop(self._to_stop())
        self._note_fleet_size()

    def engine_idle(self, index: int) -> None:
        """Engine ``index`` has stepped: a stopping replica with no request left stops."""
        if index in self._stopping and not self._engines[index].has_unfinished:
            self._stopped(index)

    def _fleet_load(self) -> FleetLoad:
        engines = [self._engines[i] for i in [*self.routable, *self._stopping]]
        waiting = self._routers.waiting()
        return FleetLoad(
            sum(e.num_running + e.num_waiting for e in engines) + len(waiting),
            sum(e.queued_prefill_tokens for e in engines)
            + sum(w.routing.num_prompt_tokens for w in waiting),
        )

    def _add_replica(self) -> int:
        """A new engine, empty, in every router's fleet; returns its index."""
        index = self._engines.add(Engine(self._config.engine_config(self._config.model)))
        self._routers.add_replica(index, self._engines[index])
        self.routable.append(index)
        return index

    def _to_stop(self) -> int:
        """The replica to stop, as ``scale_in`` chooses (router/fleet/autoscaler.py)."""
        first = self._routers[0]
        states = [first.states[i] for i in self.routable]
        ids = [state.replica_id for state in states]
        load_of = {state.replica_id: state.outstanding_requests for state in states}
        policy = first.routes.policy()
        scale_in = self._config.autoscale.scale_in
        chosen = to_stop(scale_in, ids, load_of, policy.cache_value, self._rng)
        return self.routable[ids.index(chosen)]

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
        size = len(self.routable) + len(self._starting) + len(self._stopping)
        if size != self.fleet_sizes[-1][1]:
            self.fleet_sizes.append((self._events.now, size))
