"""One replay: the workload's turns through the routers to the engines, in virtual time.

The simulation composes the replayer's rooms and hands each request from one to the
next, from its arrival to its end; no room calls back into it:

- the clock and its events (events.py), and when sessions' turns arrive (``_Sessions``);
- the routers (routers.py) and a request's way through one (routing.py);
- the engines (engines.py), and what the routers hear from them (reports.py);
- the KV that moves between them: prefill legs, holds and pulls (transfers.py);
- a fleet that grows and shrinks (scaling.py), and what is measured (metrics.py).
"""

from __future__ import annotations

from collections.abc import Callable

from loadtest.replay.config import ReplayConfig
from loadtest.replay.engines import EngineSteps
from loadtest.replay.events import (
    Delivery,
    EventQueue,
    PlannedBurst,
    PullEnds,
    StepEnds,
    Tick,
    TurnArrives,
)
from loadtest.replay.metrics import Metrics
from loadtest.replay.reports import EngineReports
from loadtest.replay.request import TurnRequest
from loadtest.replay.result import ReplayResult
from loadtest.replay.routers import Routers
from loadtest.replay.scaling import Scaling
from loadtest.replay.transfers import Transfers
from loadtest.workloads import Session, Workload
from replica.engine import Engine, EngineRequest, RequestOutput, StepResult
from router.core import ReplicaState


class Simulation:
    """One replay run; :meth:`run` returns a :class:`ReplayResult`. The same workload,
    config and policy give the same result: every random draw comes from a generator
    seeded by ``config.seed`` (the routers' own and their pick, the scale-in choice)."""

    def __init__(
        self,
        workload: Workload,
        config: ReplayConfig,
        policy: str = "round_robin",
        on_request_done: Callable[[], object] | None = None,
    ) -> None:
        self.workload = workload
        self.config = config = config.resolved()
        self.events = EventQueue()
        adapters = _adapters_by_model(workload)
        engines = [
            Engine(config.engine_config(model, tuple(sorted(adapters.get(model, ())))))
            for model in config.replica_models
        ]
        self.engines = EngineSteps(engines, self.events, config.max_burst_steps)
        self.routers = Routers(config, policy, engines, self.events)
        self.reports = EngineReports(
            self.routers.routers, self.events, config.event_delay_s, any(adapters.values())
        )
        self.policy_name = self.routers[0].routes.policy().name
        request_s = engines[0].cost.request_s
        self.metrics = Metrics(workload, config.model, config.block_size, request_s)
        self.scaling = Scaling(config, self.events, self.engines, self.routers)
        self.transfers = Transfers(self.engines, self.events, config)
        self.sessions = _Sessions(workload, self.events, request_s)
        self._on_request_done = on_request_done or (lambda: None)
        self._in_flight: dict[str, TurnRequest] = {}
        #: Prefill legs in flight (disaggregated requests), by their engine request id.
        self._prefills: dict[str, TurnRequest] = {}

    def run(self) -> ReplayResult:
        self.sessions.start()
        while (event := self.events.pop()) is not None:
            match event:
                case Tick():
                    self.scaling.tick()
                case Delivery(engine, payload):
                    self.reports.deliver(engine, payload)
                case StepEnds(engine, ended):
                    self._step_ended(engine, ended)
                case PullEnds(engine):
                    self.engines.wake(engine)
                case TurnArrives(session, turn):
                    self._arrive(session, turn)
        return self._result()

    def _arrive(self, session_index: int, turn_index: int) -> None:
        session = self.workload.sessions[session_index]
        turn = session.turns[turn_index]
        prompt = turn.prompt_token_ids
        turn.forget_prompt()
        request = self.routers.request(session, session_index, turn_index, prompt)
        router = self.routers[request.router]
        if self.config.max_outstanding:  # a gateway's admission: queue when all are full
            router.wait(request)
            self._admit_waiting(request.router)
        else:
            self._dispatch(request, router.serving(request, self.scaling.routed_to()))

    def _admit_waiting(self, router: int) -> None:
        for request, free in self.routers[router].admitted(self.scaling.routed_to()):
            self._dispatch(request, free)

    def _dispatch(self, request: TurnRequest, candidates: list[ReplicaState]) -> None:
        session = self.workload.sessions[request.session]
        router = self.routers[request.router]
        index = router.choose(request, candidates, session.cache_salt)
        record = self.metrics.dispatched(request, index, session, self.events.now)
        plan = request.routing.kv
        if plan is not None and plan.prefill is not None:
            record.path, record.prefill_replica = plan.path, router.states.index(plan.prefill)
            self._send_prefill(request, session, record.prefill_replica)
        elif plan is not None and plan.pull_from is not None:
            source = router.states.index(plan.pull_from)
            lent = self.transfers.peer(request, session, source, plan.pull_tokens)
            record.path, record.pull_fallback = plan.path, lent < plan.pull_tokens
            self._send(request, session, index, lent, source)
        else:
            self._send(request, session, index)

    def _send(
        self,
        request: TurnRequest,
        session: Session,
        index: int,
        pull: int = 0,
        source: int | None = None,
        disaggregated: bool = False,
    ) -> None:
        """Queue the request (its decode leg, if ``disaggregated``) on engine ``index``,
        with ``pull`` leading tokens to pull from engine ``source`` first."""
        turn = session.turns[request.turn]
        engine_request = EngineRequest(
            request.request_id,
            request.prompt,
            turn.max_tokens,
            ignore_eos=True,
            cache_salt=session.cache_salt,
            lora=session.adapter,
            pull_tokens=pull,
            prefilled_elsewhere=disaggregated,  # the prefill's engine counted its prompt
        )
        if not self._submitted(request, index, engine_request):
            return
        self._in_flight[request.request_id] = request
        self.routers[request.router].dispatched(request, index)
        if source is not None:
            self.transfers.pulled(request, source, index, disaggregated)
        self.engines.wake(index)

    def _send_prefill(self, request: TurnRequest, session: Session, index: int) -> None:
        """A disaggregated request's prefill leg, to engine ``index``."""
        leg = self.transfers.prefill_leg(request, session)
        if not self._submitted(request, index, leg):
            return
        self._prefills[leg.request_id] = request
        self.routers[request.router].dispatched(request, index, leg=True)
        self.engines.wake(index)

    def _submitted(self, request: TurnRequest, index: int, engine_request: EngineRequest) -> bool:
        """Queue it on engine ``index``; a request it can never take fails, recorded."""
        try:
            self.engines.submit(index, engine_request)
        except ValueError as error:
            self.metrics.records[request.request_id].error = str(error)
            self._finish(request)
            return False
        return True

    def _prefill_done(self, index: int, output: RequestOutput) -> None:
        """A prefill leg's first token: its decode leg goes, to pull what it held."""
        request = self._prefills.pop(output.request_id)
        record = self.metrics.records[request.request_id]
        record.prefilled_s, record.cached_tokens = self.events.now, output.num_cached_tokens
        self.routers[request.router].completed(request, index, output, leg=True)
        block = self.config.block_size
        full = (len(request.prompt) - 1) // block * block
        request.routing.predicted_cached_tokens = full  # the decode replica pulls them
        lent = self.transfers.held(request, index)
        record.pull_fallback = lent < full  # the hold timed out, say
        session = self.workload.sessions[request.session]
        self._send(request, session, record.replica, lent, index, disaggregated=True)

    def _step_ended(self, index: int, ended: StepResult | PlannedBurst) -> None:
        result = self.engines.ended(index, ended)
        if result is None:
            return
        freed: set[int] = set()  # routers whose requests ended: a slot for their queue
        for output in result.outputs:
            if (ended_request := self._produced(index, output)) is not None:
                freed.add(ended_request.router)
        engine = self.engines[index]
        kv_events = engine.cache.events.drain()
        self.reports.publish(index, engine, kv_events)
        self.metrics.watch(kv_events)
        self.engines.step(index)
        self.scaling.engine_idle(index)
        for router in freed if self.config.max_outstanding else ():
            self._admit_waiting(router)

    def _produced(self, index: int, output: RequestOutput) -> TurnRequest | None:
        """A request's tokens came out of engine ``index``; the request, if it ended."""
        if output.request_id in self._prefills:
            self._prefill_done(index, output)
            return None
        request = self._in_flight[output.request_id]
        router = self.routers[request.router]
        if self.metrics.produced(output, self.events.now):
            router.prefilled(request, index)
        if not output.finished:
            return None
        del self._in_flight[output.request_id]
        router.completed(request, index, output)
        self._finish(request)
        return request

    def _finish(self, request: TurnRequest) -> None:
        self._on_request_done()
        self.sessions.turn_ended(request.session, request.turn)

    def _result(self) -> ReplayResult:
        first = self.routers[0].routes
        return ReplayResult(
            self.workload.name,
            self.policy_name,
            self.config,
            list(self.metrics.records.values()),
            self.engines.engines,
            self.events.now,
            self.metrics.shared_prefix_evictions,
            self.routers.dispatched_per_replica(),
            self.scaling.fleet_sizes,
            self.scaling.scale_events,
            [change for policy in first.policies.values() for change in policy.hot_set_changes()],
            self.scaling.pool_sizes,
        )


class _Sessions:
    """When each session's turns arrive: all sessions at their start times (open loop,
    or a trace's timestamps), or ``num_users`` users playing one session after
    another (closed loop); a session's next turn its think time after the last ends."""

    def __init__(self, workload: Workload, events: EventQueue, request_s: float) -> None:
        self._workload, self._events, self._request_s = workload, events, request_s
        self._idle = list(range(len(workload.sessions)))[::-1]  # for closed loop's users

    def start(self) -> None:
        if self._workload.arrival == "closed":
            for _ in range(min(self._workload.num_users, len(self._idle))):
                self._events.schedule(0.0, TurnArrives(self._idle.pop(), 0))
            return
        for index, session in enumerate(self._workload.sessions):
            self._events.schedule(session.start_time_s, TurnArrives(index, 0))
        self._idle.clear()

    def turn_ended(self, session_index: int, turn_index: int) -> None:
        """Schedule the session's next turn, or the user's next session."""
        if self._workload.arrival == "trace":
            return
        turns = self._workload.sessions[session_index].turns
        ended = self._events.now + self._request_s  # as the client sees it
        if turn_index + 1 < len(turns):
            self._events.schedule(
                ended + turns[turn_index + 1].think_time_s,
                TurnArrives(session_index, turn_index + 1),
            )
        elif self._idle:
            self._events.schedule(ended, TurnArrives(self._idle.pop(), 0))


def _adapters_by_model(workload: Workload) -> dict[str, set[str]]:
    """The LoRA adapters the workload asks for, by the model they sit on."""
    adapters: dict[str, set[str]] = {}
    for session in workload.sessions:
        if session.model is not None and session.adapter is not None:
            adapters.setdefault(session.model, set()).add(session.adapter)
    return adapters
