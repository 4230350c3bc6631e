"""The gateway's ``GET /stats``, typed, read by the bench, the tests and operators.

It carries the gateway's whole configuration, routing knobs included, so the bench
can replay a live run with the very ``PolicyConfig`` the gateway routed with.
Encoded and decoded with the contract's codec (``replica.api.stats``).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from replica.api.token_cache import TokenCacheStats
from router.config import GatewayConfig
from router.index.key_cache import KeyCacheStats


@dataclass
class PolicyCounts:
    """One backend's requests under one policy, and how well their cache was predicted:
    requests with a prediction; of them, those the replica's figure matched exactly,
    those within one KV block of it, within one router stride, and those that
    predicted more (over) or fewer (under) cached tokens than the replica reported,
    with the tokens by which they missed; and the cached tokens predicted and reported."""

    requests: int = 0
    predictions: int = 0
    close_predictions: int = 0
    predicted_cached_tokens: int = 0
    actual_cached_tokens: int = 0
    exact_predictions: int = 0
    block_predictions: int = 0
    over_predictions: int = 0
    under_predictions: int = 0
    over_predicted_tokens: int = 0
    under_predicted_tokens: int = 0
    #: The over-predictions by cause (router/core.py, OVER_CAUSES).
    over_pending: int = 0
    over_evicted: int = 0
    over_unexplained: int = 0

    def predicted(
        self, predicted: int, actual: int, block: int, stride: int, over_cause: str | None = None
    ) -> None:
        """Count one prediction against the replica's figure (``over_cause``: why it
        found fewer, where the policy said)."""
        miss = predicted - actual
        if miss > 0 and over_cause is not None:
            name = f"over_{over_cause}"
            setattr(self, name, getattr(self, name) + 1)
        self.predictions += 1
        self.predicted_cached_tokens += predicted
        self.actual_cached_tokens += actual
        self.exact_predictions += miss == 0
        self.block_predictions += abs(miss) <= block
        self.close_predictions += abs(miss) < stride
        self.over_predictions += miss > 0
        self.under_predictions += miss < 0
        self.over_predicted_tokens += max(miss, 0)
        self.under_predicted_tokens += max(-miss, 0)


@dataclass(frozen=True)
class BackendStats:
    url: str
    replica_id: str
    #: Requests sent here (retries included) since the gateway started.
    dispatched: int
    outstanding_requests: int
    outstanding_prefill_tokens: int
    #: Per policy name (the gateway's policy can be switched while it runs).
    by_policy: dict[str, PolicyCounts]
    upstream_errors: int
    #: Whether it publishes KV events (ours do; vLLM and SGLang servers over HTTP do not).
    kv_events: bool
    #: False while its circuit is open (no requests until a probe succeeds).
    healthy: bool
    #: Its KV events pushed on ZMQ: the endpoint, and how the stream has gone.
    kv_stream: KVStreamStats | None = None
    #: The load the policy balances on: the replica's last report (every gateway's
    #: requests) plus this gateway's since; without reports, the outstanding ones.
    load_requests: int = 0
    load_prefill_tokens: int = 0
    #: KV blocks it could give a new request, as it last reported (None: not said).
    free_blocks: int | None = None
    #: Requests waiting in its engine's own queue, as it last reported, and the most its
    #: engine runs at once, as its card says (None: not said); see router/fair/slots.py.
    engine_waiting: int | None = None
    max_num_seqs: int | None = None
    #: How its cache is known: ``checking`` (its join check runs; routed approximately
    #: meanwhile), ``precise`` (from its events) or ``approximate`` (from the router's
    #: decisions), with the reason: what differs and the flag that fixes it.
    routing_mode: str = "checking"
    approximate_reason: str | None = None
    #: Join checks that could not be made, and why.
    unchecked: list[str] = field(default_factory=list)
    #: Stored blocks of its KV events that could not be keyed to the router's identities.
    unkeyed_blocks: int = 0
    #: Answers that found fewer cached tokens than predicted: where its KV events alone had
    #: said more, with no eviction told (the index and the engine disagree: the prompt's
    #: entries dropped, its stream applied again from the dispatch), and the others (the
    #: router's own decisions said more, or an eviction was told after the dispatch).
    event_disagreements: int = 0
    decision_corrections: int = 0
    #: What it says of itself: ``sim`` or ``vllm``, its model and block size (None: unknown).
    engine: str | None = None
    model: str | None = None
    block_size: int | None = None
    #: Leaving the fleet (a scale-in): sent nothing new until it goes.
    draining: bool = False
    #: What it does in a disaggregated fleet: ``both``, ``prefill`` or ``decode``.
    role: str = "both"
    #: One engine of a data-parallel server: its rank, and the server's name (which
    #: ``replica_id``, ``SERVER#dpRANK``, extends).
    data_parallel_rank: int | None = None
    server: str = ""

    @property
    def predicted_cached_tokens(self) -> int:
        return sum(counts.predicted_cached_tokens for counts in self.by_policy.values())

    @property
    def actual_cached_tokens(self) -> int:
        return sum(counts.actual_cached_tokens for counts in self.by_policy.values())


@dataclass(frozen=True)
class KVStreamStats:
    endpoint: str
    batches: int
    gaps: int
    replayed: int
    resyncs: int
    stale: bool
    #: Seconds from a batch's time stamp at the replica to its events in the index.
    latency_p50_s: float | None
    latency_p99_s: float | None
    #: The number of the batch after the last one in the index (``None``: none yet):
    #: once it equals the replica's ``kv_event_batches``, the index holds every event
    #: the replica published (what tests and operators can wait for).
    indexed_through: int | None = None
    #: Times its batch numbers started over (a new engine behind the same sockets).
    restarts: int = 0


@dataclass(frozen=True)
class TenantStats:
    requests: int
    errors: int
    prompt_tokens: int
    cached_tokens: int
    #: Cached over prompt tokens; ``None`` before the first answer that reported them.
    token_hit_rate: float | None
    #: What its fair share was charged (router/fair/fairness.py): the prompt tokens the
    #: engines did not have cached, and the tokens they generated.
    charged_tokens: int = 0
    #: Its footprint: blocks its prompts hold on each replica's GPU (by replica id),
    #: from the replicas' KV events (precise routing only).
    gpu_blocks: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class PolicyStats:
    """Every request routed under one policy: its answers, cached tokens and the time
    from dispatch to the first token (p50, p90; ``None`` before the first)."""

    requests: int
    errors: int
    prompt_tokens: int
    cached_tokens: int
    token_hit_rate: float | None
    ttft_count: int = 0
    ttft_p50_s: float | None = None
    ttft_p90_s: float | None = None


@dataclass(frozen=True)
class HotSetStats:
    """A hot prefix on several replicas (``cache_aware_replicated``)."""

    #: The key of the prefix's last stride (64 bits, hex), its model, its share of the
    #: model's recent requests, and its replicas.
    prefix: str
    model: str
    share: float
    replicas: list[str]


@dataclass(frozen=True)
class GatewayStats:
    policy: str
    #: Tries repeated on another replica, requests refused (429) and waiting now.
    retries: int
    refused: int
    queued: int
    config: GatewayConfig
    backends: list[BackendStats]
    tenants: dict[str, TenantStats] = field(default_factory=dict)
    #: Requests whose prompt the gateway could not read, routed by load alone.
    unread_prompts: int = 0
    #: Requests that carried a session key.
    session_requests: int = 0
    #: Every request it answered (or failed), and the cached tokens the replicas reported.
    totals: TenantStats = field(default_factory=lambda: TenantStats(0, 0, 0, 0, None))
    #: Its process: gateways sharing a port are told apart by it.
    pid: int = 0
    #: Per policy that has routed since the gateway started.
    policies: dict[str, PolicyStats] = field(default_factory=dict)
    #: Per model (or LoRA adapter) that requests named.
    models: dict[str, TenantStats] = field(default_factory=dict)
    #: Its tokenizer's cache of chats' pieces (None: none, as for ``bytes4``).
    tokenizer_cache: TokenCacheStats | None = None
    #: Its cache of recent long prompts' keys (router/index/key_cache.py).
    key_cache: KeyCacheStats | None = None
    #: Hot prefixes' replication sets, largest share first (none unless the policy
    #: replicates them: router/policies/replicated.py).
    hot_sets: list[HotSetStats] = field(default_factory=list)
    #: Requests by how their KV got to the replica that answered: ``local``,
    #: ``disaggregated`` (prefilled on another replica, then pulled) or ``pulled``
    #: (a peer's prefix pulled): router/policies/disaggregated.py.
    paths: dict[str, int] = field(default_factory=dict)

    def by_policy(self, policy: str) -> list[PolicyCounts]:
        """Each backend's counts under ``policy`` (zeros where it routed nothing)."""
        return [b.by_policy.get(policy, PolicyCounts()) for b in self.backends]


def for_monitoring(stats: GatewayStats) -> GatewayStats:
    """What a caller without an administrator's key sees where keys are configured: the
    fleet's health, load and hit rates, with no topology (each backend named by its
    place, no URL, its KV stream's health without its endpoint), no hot prefixes, no
    tenants and no caches whose counts follow what others send."""
    backends = [
        replace(
            b,
            url="",
            replica_id=f"backend-{place}",
            server="",
            kv_stream=replace(b.kv_stream, endpoint="") if b.kv_stream else None,
            unchecked=[],
            approximate_reason=None,
        )
        for place, b in enumerate(stats.backends)
    ]
    return replace(
        stats,
        backends=backends,
        tenants={},
        hot_sets=[],
        tokenizer_cache=None,
        key_cache=None,
    )
