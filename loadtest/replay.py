"""Offline replay: N engines and one routing policy in virtual time.

A discrete-event simulation with two kinds of event: a turn *arrives* (the policy
picks a replica and the request joins that engine's queue) and an engine step is
*done* (its tokens reach the client, finished requests release their load and
schedule their session's next turn). It drives the very ``Engine`` and ``Policy``
objects the live system uses, never sleeps, and gives the same figures for the
same seed.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from loadtest.workloads import Workload
from replica.cost_model import DEFAULT_PROFILE
from replica.engine import Engine, EngineConfig, StepResult
from replica.hashing import block_hashes, identity_seed
from replica.scheduler import SchedulerConfig
from replica.sequence import EngineRequest
from router.policies import ReplicaState, RoutingRequest, make_policy


@dataclass(frozen=True)
class ReplayConfig:
    """One simulated fleet. Every replica gets ``capacity_blocks`` KV blocks."""

    replicas: int = 1
    capacity_blocks: int = 4096
    block_size: int = 16
    profile: str = DEFAULT_PROFILE
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    model: str = "sim-llama3-8b"
    seed: int = 0

    def __post_init__(self) -> None:
        if self.replicas < 1 or self.capacity_blocks < 1:
            raise ValueError("replicas and capacity_blocks must be positive")

    def engine_config(self) -> EngineConfig:
        scheduler = SchedulerConfig(self.max_num_batched_tokens, self.max_num_seqs)
        return EngineConfig(
            self.model,
            self.capacity_blocks,
            self.block_size,
            self.profile,
            scheduler,
            seed=self.seed,
        )


@dataclass
class RequestRecord:
    """One request's fate, in virtual seconds."""

    request_id: str
    replica: int
    arrival_s: float
    prompt_tokens: int
    first_token_s: float | None = None
    finish_s: float | None = None
    cached_tokens: int = 0
    output_tokens: int = 0
    error: str | None = None
    shared_prefix_tokens: int = 0


@dataclass
class ReplayResult:
    workload: str
    policy: str
    config: ReplayConfig
    records: list[RequestRecord]
    engines: list[Engine]
    duration_s: float
    shared_prefix_evictions: int = 0
    dispatched: list[int] = field(default_factory=list)


_ARRIVE, _DONE = 0, 1


class Simulation:
    """One replay run; :meth:`run` returns a :class:`ReplayResult`."""

    def __init__(
        self,
        workload: Workload,
        config: ReplayConfig,
        policy: str = "round_robin",
        on_request_done: Callable[[], None] | None = None,
    ) -> None:
        self.workload = workload
        self.config = config
        self.now = 0.0
        self.engines = [Engine(config.engine_config()) for _ in range(config.replicas)]
        self.replicas = [
            ReplicaState(f"replica-{i}", config.capacity_blocks) for i in range(config.replicas)
        ]
        self.policy = make_policy(policy, lambda: self.now, np.random.default_rng(config.seed))
        self.records: dict[str, RequestRecord] = {}
        self._routing: dict[str, RoutingRequest] = {}
        self._stepping = [False] * config.replicas
        self._events: list[tuple[float, int, int, int, object]] = []
        self._order = 0
        self._on_request_done = on_request_done or (lambda: None)
        self._session_index = {s.session_id: i for i, s in enumerate(workload.sessions)}
        self._idle_sessions = list(range(len(workload.sessions)))[::-1]
        self._shared_hashes = self._shared_prefix_hashes()
        self._event_seqs = [0] * config.replicas
        self.shared_prefix_evictions = 0

    # ------------------------------------------------------------------ running

    def run(self) -> ReplayResult:
        self._start_sessions()
        while self._events:
            self.now, _, kind, index, payload = heapq.heappop(self._events)
            if kind == _ARRIVE:
                self._arrive(index, payload)  # type: ignore[arg-type]
            else:
                self._done(index, payload)  # type: ignore[arg-type]
        return ReplayResult(
            self.workload.name,
            self.policy.name,
            self.config,
            list(self.records.values()),
            self.engines,
            self.now,
            self.shared_prefix_evictions,
            [r.dispatched for r in self.replicas],
        )

    def _push(self, time: float, kind: int, index: int, payload: object) -> None:
        self._order += 1
        heapq.heappush(self._events, (time, self._order, kind, index, payload))

    def _start_sessions(self) -> None:
        if self.workload.arrival == "closed":
            for _ in range(min(self.workload.num_users, len(self._idle_sessions))):
                self._push(0.0, _ARRIVE, self._idle_sessions.pop(), 0)
            return
        for index, session in enumerate(self.workload.sessions):
            self._push(session.start_time_s, _ARRIVE, index, 0)
        self._idle_sessions.clear()

    def _arrive(self, session_index: int, turn_index: int) -> None:
        session = self.workload.sessions[session_index]
        turn = session.turns[turn_index]
        request_id = f"{session.session_id}/{turn_index}"
        prompt = turn.prompt_token_ids
        turn.forget_prompt()
        routing = RoutingRequest(request_id, len(prompt))
        replica = self.policy.choose(routing, self.replicas)
        index = self.replicas.index(replica)
        record = RequestRecord(request_id, index, self.now, len(prompt))
        record.shared_prefix_tokens = session.shared_prefix_tokens
        self.records[request_id] = record
        try:
            request = EngineRequest(request_id, prompt, turn.max_tokens, ignore_eos=True)
            self.engines[index].add_request(request)
        except ValueError as error:
            record.error = str(error)
            self._finish(session_index, turn_index)
            return
        self._routing[request_id] = routing
        replica.outstanding_requests += 1
        replica.outstanding_prefill_tokens += len(prompt)
        replica.dispatched += 1
        self.policy.on_dispatch(routing, replica)
        if not self._stepping[index]:
            self.engines[index].advance_to(self.now)
            self._step(index)

    def _step(self, index: int) -> None:
        engine = self.engines[index]
        result = engine.step()
        self._stepping[index] = bool(result.duration_s)
        if result.duration_s:
            self._push(engine.now, _DONE, index, result)
        elif engine.has_unfinished:
            raise RuntimeError(f"engine {index} has requests but scheduled nothing")

    def _done(self, index: int, result: StepResult) -> None:
        replica = self.replicas[index]
        for output in result.outputs:
            record = self.records[output.request_id]
            if record.first_token_s is None:
                record.first_token_s = self.now
                replica.outstanding_prefill_tokens -= record.prompt_tokens
            if output.finished:
                record.finish_s = self.now
                record.cached_tokens = output.num_cached_tokens
                record.output_tokens = output.num_output_tokens
                replica.outstanding_requests -= 1
                self.policy.on_complete(self._routing.pop(output.request_id), replica)
                session_index, turn_index = self._locate(output.request_id)
                self._finish(session_index, turn_index)
        self._count_shared_evictions(index)
        self._step(index)

    def _finish(self, session_index: int, turn_index: int) -> None:
        """A turn ended: schedule the session's next turn, or the user's next session."""
        self._on_request_done()
        session = self.workload.sessions[session_index]
        if self.workload.arrival == "trace":
            return
        if turn_index + 1 < len(session.turns):
            think = session.turns[turn_index + 1].think_time_s
            self._push(self.now + think, _ARRIVE, session_index, turn_index + 1)
        elif self._idle_sessions:
            self._push(self.now, _ARRIVE, self._idle_sessions.pop(), 0)

    def _locate(self, request_id: str) -> tuple[int, int]:
        session_id, turn = request_id.rsplit("/", 1)
        return self._session_index[session_id], int(turn)

    # ----------------------------------------------------- shared-prefix watch

    def _shared_prefix_hashes(self) -> set[int]:
        """Identities of every session's shared prefix (its system prompt) blocks."""
        seed = identity_seed(self.config.model)
        hashes: set[int] = set()
        seen_apps: set[tuple[int, int]] = set()
        for session in self.workload.sessions:
            key = (session.app, session.shared_prefix_tokens)
            if (
                key in seen_apps
                or not session.shared_prefix_tokens
                or session.turns[0].messages is None
            ):
                continue
            seen_apps.add(key)
            prompt = session.turns[0].prompt_token_ids[: session.shared_prefix_tokens]
            hashes.update(block_hashes(prompt, self.config.block_size, seed))
        return hashes

    def _count_shared_evictions(self, index: int) -> None:
        if not self._shared_hashes:
            return
        cache = self.engines[index].cache
        if cache.last_event_seq == self._event_seqs[index]:
            return
        events, _ = cache.events_since(self._event_seqs[index])
        self._event_seqs[index] = cache.last_event_seq
        for event in events:
            if event.kind == "removed":
                self.shared_prefix_evictions += len(
                    self._shared_hashes.intersection(event.block_hashes)
                )


def replay(
    workload: Workload,
    config: ReplayConfig,
    policy: str = "round_robin",
    on_request_done: Callable[[], None] | None = None,
) -> ReplayResult:
    return Simulation(workload, config, policy, on_request_done).run()
