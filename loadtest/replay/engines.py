"""The fleet's engines in virtual time: each runs while it has work, every step's end
an event.

An engine whose batch is all decodes plans several iterations as one event (a decode
burst, up to its first request's end); a request routed to it mid-burst cuts the burst
after the iteration running at that moment, so every engine does what single steps
would have done, and an engine with no new work sleeps through its whole burst however
busy the rest of the fleet is.
"""

from __future__ import annotations

from collections.abc import Iterator

from loadtest.replay.events import EventQueue, PlannedBurst, PullEnds, StepEnds
from replica.engine import Burst, Engine, EngineRequest, StepResult


class EngineSteps:
    """Engines, by index (a replica's for the whole run), and what each is running."""

    def __init__(self, engines: list[Engine], events: EventQueue, max_burst_steps: int) -> None:
        self.engines = engines
        self._events = events
        self._max_burst_steps = max_burst_steps
        #: Whether each engine has a step or burst under way (an end to come).
        self._stepping = [False] * len(engines)
        #: The burst each engine is in, with the iterations it will run (None: none).
        self._bursts: list[PlannedBurst | None] = [None] * len(engines)

    def __getitem__(self, index: int) -> Engine:
        return self.engines[index]

    def __iter__(self) -> Iterator[Engine]:
        return iter(self.engines)

    def __len__(self) -> int:
        return len(self.engines)

    def add(self, engine: Engine) -> int:
        """A new replica's engine, idle from now on; returns its index."""
        engine.advance_to(self._events.now)
        self.engines.append(engine)
        self._stepping.append(False)
        self._bursts.append(None)
        return len(self.engines) - 1

    def submit(self, index: int, request: EngineRequest) -> None:
        """Queue ``request`` on engine ``index`` (raises ``ValueError`` if it cannot
        take it); :meth:`wake` then sets the engine going."""
        engine = self.engines[index]
        if not self._stepping[index]:  # an idle engine's clock catches up first
            engine.advance_to(self._events.now)
        engine.add_request(request, self._events.now)

    def wake(self, index: int) -> None:
        """Work joined engine ``index``: an idle engine steps now, one in a burst stops
        it after the running iteration."""
        if not self._stepping[index]:
            self.engines[index].advance_to(self._events.now)
            self.step(index)
        elif self._bursts[index] is not None:
            self._cut_burst(index)

    def step(self, index: int) -> None:
        """Start engine ``index``'s next step, or burst, if it has work."""
        engine = self.engines[index]
        if self._max_burst_steps > 1 and (burst := engine.plan_burst(self._max_burst_steps)):
            self._stepping[index] = True
            self._schedule_burst(index, burst, burst.max_steps)
            return
        result = engine.step()
        self._stepping[index] = bool(result.duration_s)
        if result.duration_s:
            self._events.schedule(engine.now, StepEnds(index, result))
        elif (pull_ends := engine.next_pull_s) is not None:  # only pulls: idle till one ends
            self._events.schedule(pull_ends, PullEnds(index))
        elif engine.has_unfinished:
            raise RuntimeError(f"engine {index} has requests but scheduled nothing")

    def ended(self, index: int, ended: StepResult | PlannedBurst) -> StepResult | None:
        """What engine ``index`` produced by a step's or burst's end (a burst runs now);
        ``None`` for the end of a burst that was cut short, which is ignored."""
        if not isinstance(ended, tuple):
            return ended
        if ended is not self._bursts[index]:
            return None
        self._bursts[index] = None
        return self.engines[index].run_burst(*ended)

    def _schedule_burst(self, index: int, burst: Burst, steps: int) -> None:
        self._bursts[index] = planned = (burst, steps)
        self._events.schedule(burst.end_of(steps), StepEnds(index, planned))

    def _cut_burst(self, index: int) -> None:
        """Stop engine ``index``'s burst after the running iteration. The burst's later
        end stays queued, and is ignored when it comes."""
        burst, steps = self._bursts[index]  # type: ignore[misc]
        cut = burst.steps_past(self._events.now)
        if cut < steps:
            self._schedule_burst(index, burst, cut)
