"""Virtual time and what happens next.

Four kinds of event move the clock: a turn arrives, an engine's step (or decode burst)
ends, an engine's KV events or load report reaches the routers, and the autoscaler
looks at the fleet. Each kind waits in a heap of its own, ordered by time and then by
when it was scheduled; between kinds, a tie goes to the autoscaler's tick, then to a
delivery, then to a step's end, then to an arrival, so that what the routers hear at
a moment they know before they route at that moment.
"""

from __future__ import annotations

import heapq
import math
from typing import NamedTuple

from replica.api.kv_events import KVEvent
from replica.api.stats import LoadReport
from replica.engine import Burst, StepResult

#: A decode burst and the iterations it will run.
PlannedBurst = tuple[Burst, int]


class TurnArrives(NamedTuple):
    session: int
    turn: int


class StepEnds(NamedTuple):
    """Engine ``engine``'s step ran (its result), or its burst is to run now."""

    engine: int
    ended: StepResult | PlannedBurst


class PullEnds(NamedTuple):
    """A pull into engine ``engine`` ends: its request may join the batch."""

    engine: int


class Delivery(NamedTuple):
    """Engine ``engine``'s KV events or load report, reaching every router."""

    engine: int
    payload: list[KVEvent] | LoadReport


class Tick(NamedTuple):
    """The autoscaler's turn to look at the fleet."""


Event = TurnArrives | StepEnds | PullEnds | Delivery | Tick
TICK = Tick()


class EventQueue:
    """The clock (``now``, in virtual seconds) and the events still to come.

    :meth:`pop` moves ``now`` to the next event and returns it; ``next_tick`` is when
    the autoscaler looks next (never, by default), which keeps no run alive on its own.
    """

    def __init__(self) -> None:
        self.now = 0.0
        self.next_tick = math.inf
        self._order = 0  # ties within a heap go to the event scheduled first
        self._arrivals: list[tuple[float, int, Event]] = []
        self._step_ends: list[tuple[float, int, Event]] = []
        self._deliveries: list[tuple[float, int, Event]] = []
        #: The heaps in the order ties between them go.
        self._heaps = (self._deliveries, self._step_ends, self._arrivals)
        self._heap_of = {
            TurnArrives: self._arrivals,
            StepEnds: self._step_ends,
            PullEnds: self._step_ends,
            Delivery: self._deliveries,
        }

    def clock(self) -> float:
        """The virtual time, as the policies, fair shares and autoscaler read it."""
        return self.now

    def schedule(self, time: float, event: TurnArrives | StepEnds | PullEnds | Delivery) -> None:
        self._order += 1
        heapq.heappush(self._heap_of[type(event)], (time, self._order, event))

    def pop(self) -> Event | None:
        """The next event, ``now`` moved to its time; ``None`` once none is left."""
        if not any(self._heaps):
            return None
        heap = min(self._heaps, key=_next_time)  # the first of equals: the tie order
        if self.next_tick < _next_time(heap):
            self.now = self.next_tick
            return TICK
        self.now, _, event = heapq.heappop(heap)
        return event


def _next_time(heap: list[tuple[float, int, Event]]) -> float:
    return heap[0][0] if heap else math.inf
