"""What the routers hear from the engines: their KV events and load reports.

With several routers, each hears an engine's KV events and its load report (one after
every engine step, as a replica publishes its load on change) ``event_delay_s`` after
they happen, and counts its own dispatches since the last report
(``router.fleet.load.reported``). One router counts its own load and is told each
engine's free blocks, waiting requests (and adapters) at once; it hears the KV events
after the delay.
"""

from __future__ import annotations

from loadtest.replay.events import Delivery, EventQueue
from loadtest.replay.routing import Router
from replica.api.kv_events import KVEvent
from replica.api.stats import LoadReport
from replica.engine import Engine
from router.fleet import load


class EngineReports:
    """The engines' news, sent to every router now or as a :class:`Delivery` to come."""

    def __init__(
        self, routers: list[Router], events: EventQueue, delay_s: float, adapters: bool
    ) -> None:
        """``adapters``: whether the routers are told which adapters each engine holds
        in its slots (a workload that asks for some)."""
        self._routers, self._events = routers, events
        self._delay_s, self._adapters = delay_s, adapters

    def publish(self, index: int, engine: Engine, events: list[KVEvent]) -> None:
        """Engine ``index``'s new KV events and, after its step, its load."""
        if events:
            self._send(index, events)
        if len(self._routers) > 1:
            self._send(index, self._load_report(engine))
            return
        state = self._routers[0].states[index]
        state.free_blocks, state.engine_waiting = engine.free_blocks, engine.num_waiting
        if self._adapters:
            state.loaded_adapters = engine.adapters.resident
            state.free_adapter_slots = engine.adapters.free_slots

    def deliver(self, index: int, payload: list[KVEvent] | LoadReport) -> None:
        """Engine ``index``'s events or load, reaching every router now."""
        for router in self._routers:
            if isinstance(payload, LoadReport):
                load.reported(router.states[index], payload)
            else:
                router.routes.events(router.states[index], payload)

    def _send(self, index: int, payload: list[KVEvent] | LoadReport) -> None:
        if not self._delay_s:
            self.deliver(index, payload)
        else:
            self._events.schedule(self._events.now + self._delay_s, Delivery(index, payload))

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
