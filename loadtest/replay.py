"""Offline replay: N engines and a routing policy in virtual time.

A discrete-event simulation with two kinds of event: a turn *arrives* (the policy
picks a replica and the request joins that engine's queue) and an engine step is
*done* (its tokens reach the client, finished requests release their load and
schedule their session's next turn). It drives the very ``Engine`` and ``Policy``
objects the live system uses, never sleeps, and gives the same figures for the
same seed.

A fleet may serve several models (``ReplayConfig.fleet``), each replica one, with the
LoRA adapters the workload asks for on it: every router then routes each request
among its model's replicas with that model's policy (``router/fleet/models.py``), as a
gateway does.

With ``routers`` G > 1 the requests are spread at random over G routers, each with
its own policy, index and load view, as G gateways are: each sees the engines' KV
events and their load reports (one after every engine step, as a replica publishes
its load on change) ``event_delay_s`` after they happen, and counts its own
dispatches since the last report (``router.fleet.load.reported``). A third kind of event
delivers them.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import lru_cache

import numpy as np

from loadtest.workloads import Workload
from replica.api.config import ReplicaConfig
from replica.api.identity import affinity_key, block_hashes, identity_seed, prefix_keys
from replica.api.kv_events import KVEvent
from replica.api.stats import LoadReport
from replica.engine import Burst, Engine, EngineConfig, EngineRequest, StepResult
from router.core import ReplicaState, RoutingRequest
from router.fair.cache_budget import within_budget
from router.fair.fairness import FairQueue, FairShare, check_fairness
from router.fair.slots import with_free_slot
from router.fleet import load
from router.fleet.autoscaler import AutoscaleConfig, Autoscaler, FleetLoad, to_stop
from router.fleet.models import ModelRoutes, ServedName
from router.policies import PolicyConfig, make_policy


@dataclass(frozen=True)
class ReplayConfig:
    """One simulated fleet. Every replica gets ``capacity_blocks`` GPU KV blocks and
    ``host_blocks`` in host memory; left out, both are what the profile's hardware holds
    (as for a live replica: one function derives them, ``EngineConfig.for_replica``)."""

    replicas: int = 4
    #: GPU KV blocks per replica; the rest of a replica's shape defaults as a live one's.
    capacity_blocks: int | None = field(default=None, metadata={"derived": "the profile's GPUs"})
    profile: str = ReplicaConfig.profile
    max_num_seqs: int = ReplicaConfig.max_num_seqs
    max_num_batched_tokens: int = ReplicaConfig.max_num_batched_tokens
    model: str = ReplicaConfig.model
    seed: int = 0
    #: The router's knobs, the fleet's block size and the stride: the very object a
    #: live gateway routes with (``GatewayConfig.routing``).
    routing: PolicyConfig = field(default_factory=PolicyConfig)
    #: Decode iterations an engine may plan per event (exact: see ``Engine.plan_burst``).
    max_burst_steps: int = 64
    #: Each engine computes this many times faster than its profile's GPU.
    compute_scale: float = 1.0
    #: Host-memory KV blocks under each replica's GPU blocks (0: none), and their link.
    host_blocks: int | None = field(default=None, metadata={"derived": "the profile's host"})
    host_link: str = field(default="", metadata={"derived": "the profile's"})
    #: Routers sharing the traffic at random, each with its own index and load view,
    #: and how long the engines' KV events and load reports take to reach them.
    routers: int = 1
    event_delay_s: float = 0.0
    #: Whether each request carries its session's key, as a client sending
    #: ``x-session-id`` does.
    session_keys: bool = False
    #: Several models: ``MODEL=N,MODEL=N`` (replicas of each, in order; they sum to
    #: ``replicas``); empty: every replica serves ``model``. Each serves the LoRA
    #: adapters the workload asks for on its model, ``max_loras`` of them at once.
    fleet: str = ""
    max_loras: int = 1
    #: Requests in flight per replica, beyond which they wait in their router's queue
    #: (a gateway's ``--max-outstanding-per-replica``; 0: no limit and no queue), and
    #: who goes next from it: ``prefill``, ``vtc`` or ``fcfs`` (router/fair/fairness.py),
    #: tenants' service halving every ``fair_half_life_s`` (0: never, VTC's lift).
    max_outstanding: int = 0
    fairness: str = "prefill"
    fair_half_life_s: float = 30.0
    #: Of a replica's ``max_outstanding``, the slots a tenant beyond its share may not
    #: take (a gateway's ``--fair-reserve-per-replica``; at most all but one).
    fair_reserve_per_replica: int = 2
    #: Tenants' cache budgets, ``NAME=F,...``: each keeps its new prefixes off replicas
    #: where it holds F of the GPU blocks (a key's ``budget=F``: router/fair/cache_budget.py).
    cache_budgets: str = ""
    #: A fleet that grows and shrinks (router/fleet/autoscaler.py): it starts at ``replicas``
    #: (within the bounds), and a replica asked for serves ``replica_startup_s`` later
    #: (its engine loading the model). ``min_replicas == max_replicas``: a fixed fleet
    #: of ``replicas``.
    autoscale: AutoscaleConfig = field(default_factory=AutoscaleConfig)
    replica_startup_s: float = 30.0

    def __post_init__(self) -> None:
        if self.fleet:
            object.__setattr__(self, "replicas", len(self.replica_models))
        if self.replicas < 1:
            raise ValueError(f"replicas must be positive, got {self.replicas}")
        if self.routers < 1 or self.event_delay_s < 0:
            raise ValueError("routers must be positive and event_delay_s not negative")
        if self.max_outstanding < 0:
            raise ValueError(f"max_outstanding must not be negative, got {self.max_outstanding}")
        check_fairness(self.fairness)
        _ = self.tenant_budgets  # checks them
        if self.fair_half_life_s < 0 or self.fair_reserve_per_replica < 0:
            raise ValueError("fair_half_life_s and fair_reserve_per_replica must not be negative")
        if not self.autoscale.fixed:
            if self.fleet:
                raise ValueError("a fleet of several models (fleet) does not autoscale")
            if self.replica_startup_s < 0:
                raise ValueError("replica_startup_s must not be negative")
            bounded = min(
                self.autoscale.max_replicas, max(self.autoscale.min_replicas, self.replicas)
            )
            object.__setattr__(self, "replicas", bounded)
        if self.routing.model != self.model:  # one model: the routing knobs follow it
            object.__setattr__(self, "routing", replace(self.routing, model=self.model))
        engines = self.routing.for_engines(self.profile, self.max_num_batched_tokens)
        object.__setattr__(self, "routing", engines)
        self.engine_config()  # checks the replicas' shape

    @property
    def tenant_budgets(self) -> dict[str, float]:
        """Each budgeted tenant's cache budget."""
        budgets = {}
        for entry in filter(None, (e.strip() for e in self.cache_budgets.split(","))):
            name, _, value = entry.partition("=")
            try:
                budgets[name] = float(value)
            except ValueError:
                budgets[name] = 0.0
            if not name or not 0 < budgets[name] <= 1:
                raise ValueError(f"bad cache budget {entry!r}: expected NAME=F, 0 < F <= 1")
        return budgets

    @property
    def replica_models(self) -> list[str]:
        """The model each replica serves."""
        if not self.fleet:
            return [self.model] * self.replicas
        models = []
        for entry in self.fleet.split(","):
            model, _, count = entry.rpartition("=")
            if not model or not count.isdigit() or int(count) < 1:
                raise ValueError(f"fleet {self.fleet!r}: expected MODEL=N,MODEL=N (N at least 1)")
            models += [model] * int(count)
        return models

    @property
    def block_size(self) -> int:
        """The engines' block size, which the router hashes by: one figure for both."""
        return self.routing.block_size

    def replica_config(self) -> ReplicaConfig:
        """Each replica, as a live one would be configured."""
        return ReplicaConfig(
            model=self.model,
            num_blocks=self.capacity_blocks,
            block_size=self.block_size,
            profile=self.profile,
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            seed=self.seed,
            host_blocks=self.host_blocks,
            host_link=self.host_link,
        )

    def engine_config(self, model: str = "", adapters: tuple[str, ...] = ()) -> EngineConfig:
        """A replica's engine (serving ``model`` and ``adapters``, if given)."""
        engine = EngineConfig.for_replica(self.replica_config())
        return replace(
            engine, model=model or engine.model, lora_modules=adapters,
            max_loras=self.max_loras, compute_scale=self.compute_scale,
        )  # fmt: skip

    def resolved(self) -> ReplayConfig:
        """This fleet with its capacities made concrete."""
        engine = self.engine_config()
        return replace(self, capacity_blocks=engine.num_blocks, host_blocks=engine.host_blocks)

    def pooled(self) -> ReplayConfig:
        """One engine with the whole fleet's capacity and compute: a single shared cache."""
        n, fleet = self.replicas, self.resolved()
        assert fleet.capacity_blocks is not None and fleet.host_blocks is not None
        return replace(
            fleet,
            replicas=1,
            capacity_blocks=n * fleet.capacity_blocks,
            host_blocks=n * fleet.host_blocks,
            max_num_seqs=n * self.max_num_seqs,
            max_num_batched_tokens=n * self.max_num_batched_tokens,
            compute_scale=n * self.compute_scale,
            max_outstanding=n * self.max_outstanding,
            routers=1,
            event_delay_s=0.0,
            autoscale=AutoscaleConfig(),
        )


@dataclass
class RequestRecord:
    """One request's fate, in virtual seconds."""

    request_id: str
    session: int
    turn: int
    replica: int
    arrival_s: float
    prompt_tokens: int
    first_token_s: float | None = None
    finish_s: float | None = None
    cached_tokens: int = 0
    output_tokens: int = 0
    error: str | None = None
    shared_prefix_tokens: int = 0
    predicted_cached_tokens: int | None = None
    #: The model it asked for (``None``: the fleet's one model) and its adapter.
    model: str | None = None
    adapter: str | None = None
    #: Who sent it and its class's rank; when it left its router's queue.
    tenant: str | None = None
    priority: int = 0
    dispatched_s: float = 0.0


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
    #: The fleet's size (replicas held: serving, starting or stopping) from each time on.
    fleet_sizes: list[tuple[float, int]] = field(default_factory=list)
    #: (time, what, replica index): ``asked`` for, ``serving``, ``stopping`` (out of
    #: routing, finishing its requests), ``stopped``.
    scale_events: list[tuple[float, str, int]] = field(default_factory=list)
    #: (time, prefix key, set size) at every change of a hot prefix's replication set
    #: (``cache_aware_replicated``; the first router's).
    hot_set_changes: list[tuple[float, int, int]] = field(default_factory=list)

    @property
    def replica_hours(self) -> float:
        """Replicas held, integrated over the run, in hours."""
        sizes = self.fleet_sizes or [(0.0, self.config.replicas)]
        ends = [t for t, _ in sizes[1:]] + [max(self.duration_s, sizes[-1][0])]
        return sum(n * (end - start) for (start, n), end in zip(sizes, ends, strict=True)) / 3600


class Simulation:
    """One replay run; :meth:`run` returns a :class:`ReplayResult`.

    Two queues of events: turn arrivals and engine steps ending. An engine whose batch
    is all decodes plans several iterations as one event (a decode burst, up to its
    first request's end); a request routed to it mid-burst cuts the burst after the
    iteration running at that moment, so every engine does what single steps would
    have done, and an engine with no new work sleeps through its whole burst however
    busy the rest of the fleet is.
    """

    def __init__(
        self,
        workload: Workload,
        config: ReplayConfig,
        policy: str = "round_robin",
        on_request_done: Callable[[], object] | None = None,
    ) -> None:
        self.workload = workload
        self.config = config = config.resolved()
        self.now = 0.0
        adapters = _adapters_by_model(workload)
        self.engines = [
            Engine(config.engine_config(model, tuple(sorted(adapters.get(model, ())))))
            for model in config.replica_models
        ]
        #: Whether the routers are told which adapters each engine holds in its slots.
        self._adapters = any(adapters.values())
        self.routers = [self._router(policy, g) for g in range(config.routers)]
        self.routes, self.replicas = self.routers[0]  # the only one, by default
        self.policy = self.routes.policy()
        for _, states in self.routers:
            for state, engine in zip(states, self.engines, strict=True):
                state.free_blocks = engine.free_blocks
        self._pick_router = np.random.default_rng([config.seed, 1])
        self.records: dict[str, RequestRecord] = {}
        self.shared_prefix_evictions = 0
        self._seeds = lru_cache(maxsize=None)(identity_seed)  # (name, salt): a bounded set
        self._block_size, self._stride = config.routing.block_size, config.routing.index.stride
        #: What a request spends outside the engine, as its client sees it: added to its
        #: first token and its end (the engines are not told: admitting every request
        #: that much later would move them all alike).
        self._request_s = self.engines[0].cost.request_s
        self._in_flight: dict[str, tuple[int, int, RoutingRequest, int]] = {}  # ..., router
        self._stepping = [False] * config.replicas
        #: The burst each engine is in, with the iterations it will run (None: none).
        self._bursts: list[tuple[Burst, int] | None] = [None] * config.replicas
        self._arrivals: list[tuple[float, int, int, int]] = []  # time, order, session, turn
        #: time, order, engine, and what ends: a step run, or a burst to run now.
        self._step_ends: list[tuple[float, int, int, StepResult | tuple[Burst, int]]] = []
        self._order = 0
        self._on_request_done = on_request_done or (lambda: None)
        self._idle_sessions = list(range(len(workload.sessions)))[::-1]
        self._shared_hashes = self._shared_prefix_hashes()
        #: Events and load reports on their way to the routers: time, order, engine, what.
        self._deliveries: list[tuple[float, int, int, object]] = []
        #: Each router's requests waiting for a replica below ``max_outstanding``.
        self.fair_shares = [
            FairShare(config.fairness, config.fair_half_life_s, clock=lambda: self.now)
            for _ in self.routers
        ]
        self._queues: list[FairQueue[_Waiting]] = [FairQueue(f) for f in self.fair_shares]
        self._budgets = config.tenant_budgets
        #: The replicas routed to (by index; all but those stopping or stopped), those
        #: asked for and not yet serving (when each will), and the fleet's size in
        #: replicas held (serving, starting or stopping) from each time on.
        self._routable = list(range(config.replicas))
        self._starting: list[float] = []
        self._stopping: set[int] = set()
        self.fleet_sizes: list[tuple[float, int]] = [(0.0, config.replicas)]
        #: When each replica was asked for, began serving, left routing and stopped.
        self.scale_events: list[tuple[float, str, int]] = []
        scaling = config.autoscale
        self.autoscaler = None if scaling.fixed else Autoscaler(scaling, lambda: self.now)
        self._next_tick = 0.0 if self.autoscaler else math.inf
        self._scale_rng = np.random.default_rng([config.seed, 2])

    def _router(self, policy: str, index: int) -> tuple[ModelRoutes, list[ReplicaState]]:
        """One router: its policies (one per model, seeded apart from the other
        routers') and its replica states."""
        config = self.config
        rng = np.random.default_rng(config.seed if index == 0 else [config.seed, 0, index])
        routes = ModelRoutes(
            lambda model: make_policy(
                policy, lambda: self.now, rng, replace(config.routing, model=model)
            ),
            config.model if not config.fleet else config.replica_models[0],
        )
        states = [
            ReplicaState(
                f"replica-{i}",
                config.capacity_blocks or 0,
                model=engine.config.model,
                adapters=frozenset(engine.config.lora_modules),
            )
            for i, engine in enumerate(self.engines)
        ]
        for state in states:
            routes.added(state)
        return routes, states

    # ------------------------------------------------------------------ running

    def run(self) -> ReplayResult:
        self._start_sessions()
        arrivals, step_ends, deliveries = self._arrivals, self._step_ends, self._deliveries
        while arrivals or step_ends or deliveries:
            step = step_ends[0][0] if step_ends else math.inf
            arrival = arrivals[0][0] if arrivals else math.inf
            delivery = deliveries[0][0] if deliveries else math.inf
            if self._next_tick < min(step, arrival, delivery):
                self.now = self._next_tick
                self._autoscale()
            elif deliveries and deliveries[0][0] <= min(step, arrival):
                self.now, _, index, payload = heapq.heappop(deliveries)
                self._deliver(index, payload)
            elif step_ends and step <= arrival:
                self.now, _, index, ended = heapq.heappop(step_ends)
                self._done(index, ended)
            else:
                self.now, _, session_index, turn_index = heapq.heappop(arrivals)
                self._arrive(session_index, turn_index)
        return ReplayResult(
            self.workload.name,
            self.policy.name,
            self.config,
            list(self.records.values()),
            self.engines,
            self.now,
            self.shared_prefix_evictions,
            [
                sum(states[i].dispatched for _, states in self.routers)
                for i in range(len(self.engines))
            ],
            self.fleet_sizes,
            self.scale_events,
            [
                change
                for policy in self.routes.policies.values()
                for change in policy.hot_set_changes()
            ],
        )

    def _schedule_arrival(self, time: float, session_index: int, turn_index: int) -> None:
        self._order += 1
        heapq.heappush(self._arrivals, (time, self._order, session_index, turn_index))

    def _start_sessions(self) -> None:
        if self.workload.arrival == "closed":
            for _ in range(min(self.workload.num_users, len(self._idle_sessions))):
                self._schedule_arrival(0.0, self._idle_sessions.pop(), 0)
            return
        for index, session in enumerate(self.workload.sessions):
            self._schedule_arrival(session.start_time_s, index, 0)
        self._idle_sessions.clear()

    def _arrive(self, session_index: int, turn_index: int) -> None:
        session = self.workload.sessions[session_index]
        turn = session.turns[turn_index]
        request_id = f"{session.session_id}/{turn_index}"
        prompt = turn.prompt_token_ids
        turn.forget_prompt()
        router = int(self._pick_router.integers(len(self.routers))) if len(self.routers) > 1 else 0
        routes = self.routers[router][0]
        served = ServedName(session.model or routes.default_model, session.adapter)
        seed = self._seeds(served.name, session.cache_salt)
        stride_hashes = prefix_keys(prompt, self._block_size, self._stride, seed)
        key = session.session_id if self.config.session_keys else None
        routing = RoutingRequest(
            request_id, len(prompt), stride_hashes, session=key, model=served.model,
            adapter=served.adapter, tenant=session.tenant, priority=session.priority,
            cache_budget=self._budgets.get(session.tenant or ""),
            affinity=affinity_key(prompt, self._block_size, self._stride, seed),
        )  # fmt: skip
        waiting = _Waiting(session_index, turn_index, routing, prompt, self.now, router)
        if self.config.max_outstanding:  # a gateway's admission: queue when all are full
            self._queues[router].push(waiting, routing.tenant, routing.priority)
            self._admit_waiting(router)
        else:
            self._dispatch(waiting, self._serving(waiting))

    def _serving(self, waiting: _Waiting) -> list[ReplicaState]:
        routes, replicas = self.routers[waiting.router]
        routing = waiting.routing
        if self.autoscaler is not None:
            return [replicas[i] for i in self._routable]
        if not self.config.fleet:
            return replicas
        return routes.serving(ServedName(routing.model or routes.default_model, routing.adapter),
                              replicas)  # fmt: skip

    def _admit_waiting(self, router: int) -> None:
        """Dispatch from the router's queue while a replica below ``max_outstanding``
        serves the next in line (as slots free at a gateway)."""
        queue = self._queues[router]
        can_serve = lambda waiting: bool(self._free(waiting))  # noqa: E731
        while (waiting := queue.pop(can_serve)) is not None:
            self._dispatch(waiting, self._free(waiting))

    def _free(self, waiting: _Waiting) -> list[ReplicaState]:
        """The replicas that serve ``waiting`` with a slot free for it, as a gateway's
        are (router/fair/slots.py)."""
        routing, config = waiting.routing, self.config
        policy = self.routers[waiting.router][0].policy(routing.model)
        return with_free_slot(
            routing, self._serving(waiting), self.fair_shares[waiting.router],
            config.max_outstanding, config.fair_reserve_per_replica,
            lambda: policy.holders(routing),
        )  # fmt: skip

    def _dispatch(self, waiting: _Waiting, candidates: list[ReplicaState]) -> None:
        session_index, turn_index, routing = waiting.session, waiting.turn, waiting.routing
        session = self.workload.sessions[session_index]
        router, prompt = waiting.router, waiting.prompt
        turn = session.turns[turn_index]
        routes, replicas = self.routers[router]
        request_id = routing.request_id
        policy = routes.policy(routing.model)
        allowed = within_budget(policy, routing, candidates, (session.cache_salt,))
        replica = policy.choose(routing, allowed)
        index = replicas.index(replica)
        record = RequestRecord(
            request_id, session_index, turn_index, index, waiting.arrival_s, len(prompt)
        )
        record.shared_prefix_tokens = session.shared_prefix_tokens
        record.predicted_cached_tokens = routing.predicted_cached_tokens
        record.model, record.adapter = session.model, session.adapter
        record.tenant, record.priority = routing.tenant, routing.priority
        record.dispatched_s = self.now
        self.records[request_id] = record
        try:
            request = EngineRequest(
                request_id, prompt, turn.max_tokens, ignore_eos=True,
                cache_salt=session.cache_salt, lora=session.adapter,
            )  # fmt: skip
            self.engines[index].add_request(request)
        except ValueError as error:
            record.error = str(error)
            self._finish(session_index, turn_index)
            return
        self._in_flight[request_id] = (session_index, turn_index, routing, router)
        load.dispatched(policy, routing, replica, now=self.now)
        self.fair_shares[router].dispatched(routing)
        if not self._stepping[index]:
            self.engines[index].advance_to(self.now)
            self._step(index)
        elif self._bursts[index] is not None:
            self._cut_burst(index)

    def _step(self, index: int) -> None:
        engine = self.engines[index]
        if self.config.max_burst_steps > 1 and (
            burst := engine.plan_burst(self.config.max_burst_steps)
        ):
            self._stepping[index] = True
            self._schedule_burst(index, burst, burst.max_steps)
            return
        result = engine.step()
        self._stepping[index] = bool(result.duration_s)
        if result.duration_s:
            self._order += 1
            heapq.heappush(self._step_ends, (engine.now, self._order, index, result))
        elif engine.has_unfinished:
            raise RuntimeError(f"engine {index} has requests but scheduled nothing")

    def _schedule_burst(self, index: int, burst: Burst, steps: int) -> None:
        self._bursts[index] = planned = (burst, steps)
        self._order += 1
        heapq.heappush(self._step_ends, (burst.end_of(steps), self._order, index, planned))

    def _cut_burst(self, index: int) -> None:
        """A request joined engine ``index`` mid-burst: stop after the running iteration.
        The burst's later end stays queued, and is ignored when it comes."""
        burst, steps = self._bursts[index]  # type: ignore[misc]
        cut = burst.steps_past(self.now)
        if cut < steps:
            self._schedule_burst(index, burst, cut)

    def _done(self, index: int, ended: StepResult | tuple[Burst, int]) -> None:
        if isinstance(ended, tuple):
            if ended is not self._bursts[index]:
                return  # a burst's end that was cut short
            self._bursts[index] = None
            result = self.engines[index].run_burst(*ended)
        else:
            result = ended
        freed: set[int] = set()  # routers whose requests ended: a slot for their queue
        for output in result.outputs:
            record = self.records[output.request_id]
            session_index, turn_index, routing, router = self._in_flight[output.request_id]
            routes, replica = self.routers[router][0], self.routers[router][1][index]
            policy = routes.policy(routing.model)
            if record.first_token_s is None:
                record.first_token_s = self.now + self._request_s
                load.prefilled(routing, replica)
            if output.finished:
                del self._in_flight[output.request_id]
                record.finish_s = self.now + self._request_s
                record.cached_tokens = output.num_cached_tokens
                record.output_tokens = output.num_output_tokens
                load.completed(policy, routing, replica, output.num_cached_tokens)
                self.fair_shares[router].ended(
                    routing, output.num_cached_tokens, output.num_output_tokens
                )
                freed.add(router)
                self._finish(session_index, turn_index)
        self._forward_kv_events(index)
        if len(self.routers) > 1:  # a replica publishes its load on change
            engine = self.engines[index]
            report = LoadReport(
                engine.num_running, engine.num_waiting, engine.queued_prefill_tokens,
                ts=self.now, free_blocks=engine.free_blocks,
                adapters=engine.adapters.resident if self._adapters else None,
                free_adapter_slots=engine.adapters.free_slots if self._adapters else None,
            )  # fmt: skip
            self._send(index, report)
        else:  # one router counts its own load; the engine's free blocks it is told at once
            state, engine = self.routers[0][1][index], self.engines[index]
            state.free_blocks = engine.free_blocks
            if self._adapters:
                state.loaded_adapters = engine.adapters.resident
                state.free_adapter_slots = engine.adapters.free_slots
        self._step(index)
        if index in self._stopping and not self.engines[index].has_unfinished:
            self._stopped(index)
        for router in freed if self.config.max_outstanding else ():
            self._admit_waiting(router)

    def _finish(self, session_index: int, turn_index: int) -> None:
        """A turn ended: schedule the session's next turn, or the user's next session."""
        self._on_request_done()
        session = self.workload.sessions[session_index]
        if self.workload.arrival == "trace":
            return
        if turn_index + 1 < len(session.turns):
            think = session.turns[turn_index + 1].think_time_s
            self._schedule_arrival(
                self.now + self._request_s + think, session_index, turn_index + 1
            )
        elif self._idle_sessions:
            self._schedule_arrival(self.now + self._request_s, self._idle_sessions.pop(), 0)

    # ------------------------------------------------------------ autoscaling

    def _autoscale(self) -> None:
        """Look at the fleet (every ``interval_s`` while there is work): admit the
        replicas that have started, and grow or shrink it as the autoscaler says."""
        assert self.autoscaler is not None
        self._next_tick = self.now + self.config.autoscale.interval_s
        while self._starting and self._starting[0] <= self.now:
            self._starting.pop(0)
            self._add_replica()
            self.scale_events.append((self.now, "serving", len(self.engines) - 1))
        serving = len(self._routable) + len(self._starting)
        wanted = self.autoscaler.decide(serving, self._fleet_load())
        for _ in range(wanted - serving):
            self._starting.append(self.now + self.config.replica_startup_s)
            self.scale_events.append(
                (self.now, "asked", len(self.engines) + len(self._starting) - 1)
            )
        for _ in range(serving - wanted):
            if self._starting:  # not serving yet: nothing to lose
                self._starting.pop()
            elif len(self._routable) > 1:
                self._stop(self._to_stop())
        self._note_fleet_size()

    def _fleet_load(self) -> FleetLoad:
        engines = [self.engines[i] for i in [*self._routable, *self._stopping]]
        waiting = [w for queue in self._queues for w in queue]
        return FleetLoad(
            sum(e.num_running + e.num_waiting for e in engines) + len(waiting),
            sum(e.queued_prefill_tokens for e in engines)
            + sum(w.routing.num_prompt_tokens for w in waiting),
        )

    def _add_replica(self) -> None:
        """A new engine, empty, in every router's fleet."""
        index, config = len(self.engines), self.config
        engine = Engine(config.engine_config(config.model))
        engine.advance_to(self.now)
        self.engines.append(engine)
        self._stepping.append(False)
        self._bursts.append(None)
        for routes, states in self.routers:
            state = ReplicaState(
                f"replica-{index}", config.capacity_blocks or 0, model=config.model
            )
            state.free_blocks = engine.free_blocks
            states.append(state)
            routes.added(state)
        self._routable.append(index)

    def _to_stop(self) -> int:
        """The replica to stop, as ``scale_in`` chooses (router/fleet/autoscaler.py)."""
        routes, states = self.routers[0]
        policy = routes.policy()
        ids = [states[i].replica_id for i in self._routable]
        load_of = {states[i].replica_id: states[i].outstanding_requests for i in self._routable}
        scale_in = self.config.autoscale.scale_in
        chosen = to_stop(scale_in, ids, load_of, policy.cache_value, self._scale_rng)
        return self._routable[ids.index(chosen)]

    def _stop(self, index: int) -> None:
        """Route nothing more to replica ``index``; it stops once its requests end."""
        self._routable.remove(index)
        self._stopping.add(index)
        self.scale_events.append((self.now, "stopping", index))
        if not self.engines[index].has_unfinished:
            self._stopped(index)

    def _stopped(self, index: int) -> None:
        self._stopping.discard(index)
        self.scale_events.append((self.now, "stopped", index))
        for routes, states in self.routers:
            routes.removed(states[index])
        self._note_fleet_size()

    def _note_fleet_size(self) -> None:
        size = len(self._routable) + len(self._starting) + len(self._stopping)
        if size != self.fleet_sizes[-1][1]:
            self.fleet_sizes.append((self.now, size))

    # ----------------------------------------------------- shared-prefix watch

    def _shared_prefix_hashes(self) -> set[int]:
        """Identities of every session's shared prefix (its system prompt) blocks."""
        hashes: set[int] = set()
        seen_apps: set[tuple[int, int, str | None]] = set()
        for session in self.workload.sessions:
            key = (session.app, session.shared_prefix_tokens, session.served_name)
            if (
                key in seen_apps
                or not session.shared_prefix_tokens
                or session.turns[0].messages is None
            ):
                continue
            seen_apps.add(key)
            prompt = session.turns[0].prompt_token_ids[: session.shared_prefix_tokens]
            seed = identity_seed(session.served_name or self.config.model)
            hashes.update(block_hashes(prompt, self.config.block_size, seed))
        return hashes

    def _forward_kv_events(self, index: int) -> None:
        """Hand an engine's new KV events to the policy; watch for shared-prefix evictions."""
        events = self.engines[index].cache.events.drain()
        if not events:
            return
        self._send(index, events)
        if not self._shared_hashes:
            return
        for event in events:
            if event.kind == "removed":
                evicted = self._shared_hashes.intersection(event.block_hashes)
                self.shared_prefix_evictions += len(evicted)

    def _send(self, index: int, payload: list[KVEvent] | LoadReport) -> None:
        """Engine ``index``'s events or load, to every router, after the delay."""
        if not self.config.event_delay_s:
            self._deliver(index, payload)
            return
        self._order += 1
        delivery = (self.now + self.config.event_delay_s, self._order, index, payload)
        heapq.heappush(self._deliveries, delivery)

    def _deliver(self, index: int, payload: object) -> None:
        for routes, states in self.routers:
            if isinstance(payload, LoadReport):
                load.reported(states[index], payload)
            else:
                routes.events(states[index], payload)  # type: ignore[arg-type]


@dataclass(frozen=True)
class _Waiting:
    """A request that arrived at its router, not yet dispatched."""

    session: int
    turn: int
    routing: RoutingRequest
    prompt: np.ndarray
    arrival_s: float
    router: int


def _adapters_by_model(workload: Workload) -> dict[str, set[str]]:
    """The LoRA adapters the workload asks for, by the model they sit on."""
    adapters: dict[str, set[str]] = {}
    for session in workload.sessions:
        if session.model is not None and session.adapter is not None:
            adapters.setdefault(session.model, set()).add(session.adapter)
    return adapters


def replay(
    workload: Workload,
    config: ReplayConfig,
    policy: str = "round_robin",
    on_request_done: Callable[[], object] | None = None,
) -> ReplayResult:
    return Simulation(workload, config, policy, on_request_done).run()


@dataclass(frozen=True)
class Bound:
    """Hits an unlimited cache shared by the whole fleet would score: the reusable
    fraction of the workload, for requests in the order they arrived."""

    prompt_tokens: int
    cached_tokens: int
    query_blocks: int
    hit_blocks: int


def infinite_cache_bound(workload: Workload, result: ReplayResult) -> Bound:
    block_size = result.config.block_size
    seeds = lru_cache(maxsize=None)(identity_seed)  # by (name, salt): a replay's are few
    seen: set[int] = set()
    prompt_tokens = cached_tokens = query_blocks = hit_blocks = 0
    for record in sorted(result.records, key=lambda r: r.arrival_s):
        session = workload.sessions[record.session]
        turn = session.turns[record.turn]
        prompt = turn.prompt_token_ids
        turn.forget_prompt()
        name = session.served_name or result.config.model
        hashes = block_hashes(prompt, block_size, seeds(name, session.cache_salt))
        limit = (len(prompt) - 1) // block_size  # an engine computes the last token
        hits = next((i for i, h in enumerate(hashes[:limit]) if h not in seen), limit)
        seen.update(hashes)
        prompt_tokens += len(prompt)
        cached_tokens += hits * block_size
        query_blocks += len(hashes)
        hit_blocks += hits
    return Bound(prompt_tokens, cached_tokens, query_blocks, hit_blocks)
