"""The simulated fleet's shape: replicas, their engines, the routers in front of them.

One frozen dataclass, the single source of ``prefix-router replay``'s fleet flags; it
derives what a live replica would (its blocks from the profile's hardware) and checks
the rest in ``__post_init__``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from replica.api.config import ReplicaConfig
from replica.engine import EngineConfig
from router.config import GatewayConfig
from router.fair.fairness import check_fairness
from router.fleet.autoscaler import AutoscaleConfig
from router.policies import PolicyConfig


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
    #: Each engine runs this many times faster than its profile's hardware (its steps,
    #: host loads and pulls: the twin of a live replica's ``speedup``).
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
    #: Requests a tenant beyond its share may leave waiting in an engine's own queue
    #: (a gateway's ``--max-engine-waiting``; 0: engines' queues not asked).
    max_engine_waiting: int = GatewayConfig.max_engine_waiting
    #: Tenants' cache budgets, ``NAME=F,...``: each keeps its new prefixes off replicas
    #: where it holds F of the GPU blocks (a key's ``budget=F``: router/fair/cache_budget.py).
    cache_budgets: str = ""
    #: A fleet that grows and shrinks (router/fleet/autoscaler.py): it starts at ``replicas``
    #: (within the bounds; a P/D fleet's pools each within them, each scaled apart), and
    #: a replica asked for serves ``replica_startup_s`` later (its engine loading the
    #: model). ``min_replicas == max_replicas``: a fixed fleet of ``replicas``.
    autoscale: AutoscaleConfig = field(default_factory=AutoscaleConfig)
    replica_startup_s: float = 30.0
    #: A disaggregated fleet: this many replicas that prefill, and ``decode`` that
    #: decode (both 0: every replica does both); either set, ``replicas`` is their sum.
    #: The P/D policies (``pd_*``) read the roles, the others route to every replica.
    prefill: int = 0
    #: The disaggregated fleet's replicas that decode (see ``prefill``).
    decode: int = 0
    #: Seconds a prefill replica holds a prompt's blocks for the decode replica's pull.
    kv_hold_s: float = 30.0
    #: What a request must meet to count in the goodput: its time to first token, and
    #: the 99th percentile of its inter-token latencies (DistServe's per-request SLOs;
    #: 2 s and 100 ms: a chat's first words within two seconds, streamed faster than
    #: people read).
    slo_ttft_s: float = 2.0
    slo_itl_s: float = 0.1

    def __post_init__(self) -> None:
        if self.fleet:
            object.__setattr__(self, "replicas", len(self.replica_models))
        if self.prefill < 0 or self.decode < 0:
            raise ValueError("prefill and decode must not be negative")
        if self.prefill or self.decode:
            if self.fleet:
                raise ValueError("a P/D fleet (prefill, decode) serves one model")
            if not self.autoscale.fixed:  # each pool starts within the bounds
                object.__setattr__(self, "prefill", self._bounded(self.prefill))
                object.__setattr__(self, "decode", self._bounded(self.decode))
            object.__setattr__(self, "replicas", self.prefill + self.decode)
        if self.kv_hold_s < 0 or self.slo_ttft_s <= 0 or self.slo_itl_s <= 0:
            raise ValueError("kv_hold_s must not be negative, the SLOs must be positive")
        if self.replicas < 1:
            raise ValueError(f"replicas must be positive, got {self.replicas}")
        if self.routers < 1 or self.event_delay_s < 0:
            raise ValueError("routers must be positive and event_delay_s not negative")
        if self.max_outstanding < 0:
            raise ValueError(f"max_outstanding must not be negative, got {self.max_outstanding}")
        check_fairness(self.fairness)
        _ = self.tenant_budgets  # checks them
        if min(self.fair_half_life_s, self.fair_reserve_per_replica, self.max_engine_waiting) < 0:
            raise ValueError(
                "fair_half_life_s, fair_reserve_per_replica and max_engine_waiting must not be"
                " negative"
            )
        if not self.autoscale.fixed:
            if self.fleet:
                raise ValueError("a fleet of several models (fleet) does not autoscale")
            if self.replica_startup_s < 0:
                raise ValueError("replica_startup_s must not be negative")
            if not (self.prefill or self.decode):
                object.__setattr__(self, "replicas", self._bounded(self.replicas))
        if self.routing.model != self.model:  # one model: the routing knobs follow it
            object.__setattr__(self, "routing", replace(self.routing, model=self.model))
        engines = self.routing.for_engines(self.profile, self.max_num_batched_tokens)
        object.__setattr__(self, "routing", engines)
        self.engine_config()  # checks the replicas' shape

    def _bounded(self, replicas: int) -> int:
        """``replicas`` within the autoscaler's bounds (each pool's, in a P/D fleet)."""
        return min(self.autoscale.max_replicas, max(self.autoscale.min_replicas, replicas))

    @property
    def tenant_budgets(self) -> dict[str, float]:
        """Each budgeted tenant's cache budget."""
        return _cache_budgets(self.cache_budgets)

    @property
    def replica_models(self) -> list[str]:
        """The model each replica serves."""
        return _replica_models(self.fleet) if self.fleet else [self.model] * self.replicas

    @property
    def roles(self) -> list[str]:
        """What each replica does: ``prefill``, ``decode`` or ``both``."""
        if not (self.prefill or self.decode):
            return ["both"] * self.replicas
        return ["prefill"] * self.prefill + ["decode"] * self.decode

    @property
    def pd(self) -> str:
        """The P/D split, ``P:D`` (``0:0``: every replica does both)."""
        return f"{self.prefill}:{self.decode}"

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
            engine,
            model=model or engine.model,
            lora_modules=adapters,
            max_loras=self.max_loras,
            compute_scale=self.compute_scale,
            peer_link=self.routing.kv.peer_link,
        )

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
            prefill=0,
            decode=0,
        )


def _cache_budgets(text: str) -> dict[str, float]:
    """``NAME=F,...`` as each tenant's budget, checked: 0 < F <= 1."""
    budgets = {}
    for entry in filter(None, (e.strip() for e in text.split(","))):
        name, _, value = entry.partition("=")
        try:
            budgets[name] = float(value)
        except ValueError:
            budgets[name] = 0.0
        if not name or not 0 < budgets[name] <= 1:
            raise ValueError(f"bad cache budget {entry!r}: expected NAME=F, 0 < F <= 1")
    return budgets


def _replica_models(fleet: str) -> list[str]:
    """``MODEL=N,MODEL=N`` as the model of each replica, in order."""
    models = []
    for entry in fleet.split(","):
        model, _, count = entry.rpartition("=")
        if not model or not count.isdigit() or int(count) < 1:
            raise ValueError(f"fleet {fleet!r}: expected MODEL=N,MODEL=N (N at least 1)")
        models += [model] * int(count)
    return models
