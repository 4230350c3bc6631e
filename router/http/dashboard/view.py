"""One refresh of the dashboard: the figures it shows, computed on request.

Everything is read from state the gateway keeps anyway (its accounting, its load
counts, its policy's prefix index, the hot prefixes it counts) plus each replica's
``/stats`` fetched now, concurrently, for what only the replica knows: its cache's
occupancy in both tiers and its own token hit rate. A refresh costs the gateway in
proportion to its replicas and the hot prefixes shown, never to its traffic.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields

import aiohttp

from replica.api import stats as stats_codec
from replica.api.stats import ReplicaStats, TransferFigures
from router.core import ReplicaState
from router.fleet.backends import Backend
from router.gateway import Gateway
from router.http.dashboard.history import (
    History,
    Point,
    PolicySample,
    ReplicaRates,
    ReplicaSample,
    Sample,
    replica_rates,
)
from router.index.hot_prefixes import HotPrefix
from router.index.prefix_index import PrefixIndex
from router.path.latency import TTFT_BUCKETS
from router.stats import BackendStats, GatewayStats, PolicyCounts


@dataclass(frozen=True)
class ReplicaView:
    replica_id: str
    url: str
    healthy: bool
    #: Routing decisions that chose it since the gateway started, and their rate.
    dispatched: int
    outstanding_requests: int
    #: Prompt tokens this gateway sent there that are not prefilled yet.
    outstanding_prefill_tokens: int
    #: What the policy balances on (the replica's report plus what was sent since).
    load_requests: int
    load_prefill_tokens: int
    rates: ReplicaRates
    #: Its cache, as it reports (``None``: not one of ours, or it did not answer).
    gpu_blocks: int | None
    gpu_cached_blocks: int | None
    host_blocks: int | None
    host_cached_blocks: int | None
    #: Its own token hit rate since its last reset, both tiers.
    token_hit_rate: float | None
    #: Router keys the policy's index holds for it (``None``: no index).
    index_keys: int | None
    #: How the router knows its cache (``checking``, ``precise``, ``approximate``), and
    #: why approximately: what differs from the gateway, and the flag that fixes it.
    routing_mode: str = "checking"
    approximate_reason: str | None = None
    #: The base model it serves, and the LoRA adapters in its GPU slots as it last
    #: reported (``None``: it does not say).
    model: str | None = None
    loaded_adapters: list[str] | None = None
    #: Its role in a disaggregated fleet, and the KV it moved as it reports (``None``:
    #: it does not say): pulls in, tokens pulled, blocks lent, fallbacks.
    role: str = "both"
    transfers: TransferFigures | None = None


@dataclass(frozen=True)
class ModelView:
    """A model or LoRA adapter the fleet serves, and the requests that named it."""

    name: str
    #: The base model an adapter runs on (``None``: a base model).
    base: str | None
    #: Replicas that serve it, and (an adapter) those holding it in a GPU slot now.
    replicas: list[str]
    loaded_on: list[str]
    requests: int
    errors: int
    token_hit_rate: float | None


@dataclass(frozen=True)
class TenantView:
    """A tenant (API key's name): what it sent, what it was charged for its share of a
    saturated fleet, and its footprint in the replicas' caches."""

    name: str
    requests: int
    errors: int
    token_hit_rate: float | None
    charged_tokens: int
    #: Blocks its prompts hold on the GPUs, in all and on each replica (by id).
    gpu_blocks: int
    gpu_blocks_by_replica: dict[str, int]


@dataclass(frozen=True)
class PolicyView:
    requests: int
    errors: int
    token_hit_rate: float | None
    ttft_p50_s: float | None
    ttft_p90_s: float | None
    #: Predictions within one stride of the cached tokens the replica reported.
    predictions: int
    close_predictions: int
    prediction_accuracy: float | None


@dataclass(frozen=True)
class Holder:
    replica_id: str
    #: Leading tokens of the latest prompt through the prefix held, on GPU and on host only.
    gpu_tokens: int
    host_tokens: int


@dataclass(frozen=True)
class HotPrefixView:
    #: The leading identity: 64 bits of xxh3, salted per tenant, in hex.
    hash: str
    requests: int
    #: Full strides of the latest prompt through it.
    prompt_tokens: int
    #: ``None``: the policy keeps no prefix index, so who holds it is unknown.
    holders: list[Holder] | None
    #: Its first prompt's first tokens, decoded; only when an administrator asks.
    text: str | None = None
    #: The replicas its popular part is spread over on purpose (``None``: one replica,
    #: or a policy without replication sets: router/policies/replicated.py).
    replicated_on: list[str] | None = None


@dataclass(frozen=True)
class PoolView:
    """The replicas of one role, summed: a disaggregated fleet's prefill and decode
    pools (``both``: replicas that do both, as every replica of an aggregated fleet)."""

    role: str
    replicas: list[str]
    healthy: int
    outstanding_requests: int
    outstanding_prefill_tokens: int
    #: Their GPU caches as they report (``None``: none of them says).
    gpu_blocks: int | None
    gpu_cached_blocks: int | None
    #: The KV they moved, summed over those that report it.
    transfers: TransferFigures


@dataclass(frozen=True)
class DashboardView:
    ts: float
    policy: str
    backends: int
    requests: int
    token_hit_rate: float | None
    queued: int
    refused: int
    retries: int
    replicas: list[ReplicaView]
    policies: dict[str, PolicyView]
    hot_prefixes: list[HotPrefixView]
    models: list[ModelView] = field(default_factory=list)
    tenants: list[TenantView] = field(default_factory=list)
    #: Per policy, the chart points after the ``since`` the page asked for.
    series: dict[str, list[Point]] = field(default_factory=dict)
    text_shown: bool = False
    #: The replicas by role, prefill first, and the requests by how their KV got to
    #: the replica that answered (``local``, ``disaggregated``, ``pulled``).
    pools: list[PoolView] = field(default_factory=list)
    paths: dict[str, int] = field(default_factory=dict)


async def replica_figures(gateway: Gateway, timeout_s: float) -> dict[str, ReplicaStats | None]:
    """Each backend's ``/stats`` now, concurrently; ``None`` where it did not answer."""
    backends = gateway.pool.backends
    found = await asyncio.gather(*(_replica_stats(gateway, b, timeout_s) for b in backends))
    return {b.state.replica_id: stats for b, stats in zip(backends, found, strict=True)}


async def _replica_stats(
    gateway: Gateway, backend: Backend, timeout_s: float
) -> ReplicaStats | None:
    try:
        async with gateway.pool.client.get(
            f"{backend.url}/stats", timeout=aiohttp.ClientTimeout(total=timeout_s)
        ) as response:
            if response.status != 200:
                return None  # not one of ours (vLLM, SGLang have no /stats)
            return stats_codec.decode(ReplicaStats, await response.read())
    except (aiohttp.ClientError, TimeoutError, ValueError):
        return None


def take_sample(
    stats: GatewayStats,
    gateway: Gateway,
    replicas: Mapping[str, ReplicaStats | None],
    ts: float,
    predicted: Mapping[str, PolicyCounts],
) -> Sample:
    """The counters that rates and charts are differences of."""
    policies = {}
    for name, counts in gateway.accounting.policies.items():
        guesses = predicted.get(name, PolicyCounts())  # zeros once its backends are gone
        policies[name] = PolicySample(
            counts.requests,
            counts.prompt_tokens,
            counts.cached_tokens,
            guesses.predictions,
            guesses.close_predictions,
            _ttft(gateway, name),
        )
    replica_samples = {}
    for backend in stats.backends:
        own = replicas.get(backend.replica_id)
        query, hit = (own.cache.query_tokens, own.cache.hit_tokens) if own else (None, None)
        replica_samples[backend.replica_id] = ReplicaSample(backend.dispatched, query, hit)
    return Sample(ts, policies, replica_samples)


def _ttft(gateway: Gateway, policy: str) -> tuple[int, ...]:
    histogram = gateway.accounting.ttft.get(policy)
    return histogram.snapshot() if histogram else (0,) * (len(TTFT_BUCKETS) + 1)


def build(
    gateway: Gateway,
    history: History,
    replicas: Mapping[str, ReplicaStats | None],
    ts: float,
    since: float,
    show_text: bool,
    hot_shown: int,
) -> DashboardView:
    """The figures of one refresh (and a history sample, if one is due)."""
    stats = gateway.stats()
    predicted = _predictions(stats)
    now = take_sample(stats, gateway, replicas, ts, predicted)
    starts = {name: history.window_start(now, name) for name in now.replicas}
    states = {b.state.replica_id: b.state for b in gateway.pool.backends}
    history.add(now)
    replica_views = [
        _replica_view(
            gateway,
            states.get(b.replica_id),
            b,
            replicas.get(b.replica_id),
            now,
            starts[b.replica_id],
        )
        for b in stats.backends
    ]
    return DashboardView(
        ts=ts,
        policy=stats.policy,
        backends=len(stats.backends),
        requests=stats.totals.requests,
        token_hit_rate=stats.totals.token_hit_rate,
        queued=stats.queued,
        refused=stats.refused,
        retries=stats.retries,
        replicas=replica_views,
        policies=_policy_views(stats, predicted),
        hot_prefixes=_hot_prefixes(gateway, hot_shown, show_text),
        models=_models(gateway, stats),
        tenants=_tenants(stats),
        series=history.points(since),
        text_shown=show_text,
        pools=_pools(replica_views),
        paths=dict(sorted(stats.paths.items())),
    )


#: The order pools are shown in (replica.api.config.ROLES, as a disaggregated request
#: goes through them).
POOL_ORDER = ("prefill", "decode", "both")


def _pools(replicas: list[ReplicaView]) -> list[PoolView]:
    """The replicas summed by role, in :data:`POOL_ORDER`."""
    pools = []
    for role in sorted({r.role for r in replicas}, key=_role_rank):
        members = [r for r in replicas if r.role == role]
        reported = [r for r in members if r.gpu_blocks is not None]
        moved = [asdict(r.transfers) for r in members if r.transfers is not None]
        transfers = TransferFigures(**{k: sum(m[k] for m in moved) for k in _TRANSFER_FIELDS})
        pools.append(
            PoolView(
                role,
                [r.replica_id for r in members],
                sum(r.healthy for r in members),
                sum(r.outstanding_requests for r in members),
                sum(r.outstanding_prefill_tokens for r in members),
                sum(r.gpu_blocks or 0 for r in reported) if reported else None,
                sum(r.gpu_cached_blocks or 0 for r in reported) if reported else None,
                transfers,
            )
        )
    return pools


_TRANSFER_FIELDS = [f.name for f in fields(TransferFigures)]


def _role_rank(role: str) -> tuple[int, str]:
    return (POOL_ORDER.index(role) if role in POOL_ORDER else len(POOL_ORDER), role)


def _replica_view(
    gateway: Gateway,
    state: ReplicaState | None,
    backend: BackendStats,
    own: ReplicaStats | None,
    now: Sample,
    start: Sample | None,
) -> ReplicaView:
    name = backend.replica_id
    seconds = now.ts - start.ts if start else 0.0
    rates = replica_rates(now.replicas[name], start.replicas.get(name) if start else None, seconds)
    cache = own.cache if own else None
    policy = gateway.models.policy(backend.model)
    index = policy.prefix_index()
    loaded = state.loaded_adapters if state else None
    return ReplicaView(
        name,
        backend.url,
        backend.healthy,
        backend.dispatched,
        backend.outstanding_requests,
        backend.outstanding_prefill_tokens,
        backend.load_requests,
        backend.load_prefill_tokens,
        rates,
        cache.num_blocks if cache else None,
        cache.cached_blocks if cache else None,
        cache.host_num_blocks if cache else None,
        cache.host_cached_blocks if cache else None,
        cache.token_hit_rate if cache else None,
        index.num_entries(name) if index else None,
        backend.routing_mode,
        backend.approximate_reason,
        gateway.models.model_of(state) if state else backend.model,
        sorted(loaded) if loaded is not None else None,
        backend.role,
        own.transfers if own else None,
    )


def _tenants(stats: GatewayStats) -> list[TenantView]:
    views = []
    for name, t in sorted(stats.tenants.items()):
        blocks = sum(t.gpu_blocks.values())
        views.append(
            TenantView(
                name, t.requests, t.errors, t.token_hit_rate, t.charged_tokens, blocks, t.gpu_blocks
            )
        )
    return views


def _models(gateway: Gateway, stats: GatewayStats) -> list[ModelView]:
    """Every model and adapter served, then any that requests named and none serves."""
    views = []
    served = gateway.models.names()
    for name, base in served:
        replicas = gateway.models.replicas(base or name)
        if base is not None:
            replicas = [r for r in replicas if name in r.adapters]
        loaded = [r.replica_id for r in replicas if name in (r.loaded_adapters or ())]
        views.append(_model_view(name, base, [r.replica_id for r in replicas], loaded, stats))
    known = {name for name, _ in served}
    views += [_model_view(n, None, [], [], stats) for n in sorted(stats.models) if n not in known]
    return views


def _model_view(
    name: str, base: str | None, replicas: list[str], loaded: list[str], stats: GatewayStats
) -> ModelView:
    counts = stats.models.get(name)
    requests, errors = (counts.requests, counts.errors) if counts else (0, 0)
    hit_rate = counts.token_hit_rate if counts else None
    return ModelView(name, base, sorted(replicas), sorted(loaded), requests, errors, hit_rate)


def _predictions(stats: GatewayStats) -> dict[str, PolicyCounts]:
    """Each policy's counts summed over the backends."""
    totals: dict[str, PolicyCounts] = {}
    for backend in stats.backends:
        for name, counts in backend.by_policy.items():
            total = totals.setdefault(name, PolicyCounts())
            total.requests += counts.requests
            total.predictions += counts.predictions
            total.close_predictions += counts.close_predictions
            total.predicted_cached_tokens += counts.predicted_cached_tokens
            total.actual_cached_tokens += counts.actual_cached_tokens
    return totals


def _policy_views(
    stats: GatewayStats, predicted: Mapping[str, PolicyCounts]
) -> dict[str, PolicyView]:
    views = {}
    for name, policy in stats.policies.items():
        counts = predicted.get(name, PolicyCounts())
        accuracy = counts.close_predictions / counts.predictions if counts.predictions else None
        views[name] = PolicyView(
            policy.requests,
            policy.errors,
            policy.token_hit_rate,
            policy.ttft_p50_s,
            policy.ttft_p90_s,
            counts.predictions,
            counts.close_predictions,
            accuracy,
        )
    return views


def _hot_prefixes(gateway: Gateway, count: int, show_text: bool) -> list[HotPrefixView]:
    # identities are seeded per model: a prefix is held only in its model's index
    policies = gateway.models.policies.values()
    indexes = [index for p in policies if (index := p.prefix_index()) is not None]
    stride = gateway.config.routing.stride_tokens
    views = []
    for prefix in gateway.hot_prefixes.top(count):
        text = gateway.tokenizers.of(prefix.model).decode(prefix.tokens) if show_text else None
        holders = [h for index in indexes for h in _holders(index, prefix)] if indexes else None
        tokens = len(prefix.stride_hashes) * stride
        name = f"{prefix.leading:016x}"
        views.append(
            HotPrefixView(name, prefix.requests, tokens, holders, text, _set_of(gateway, prefix))
        )
    return views


def _set_of(gateway: Gateway, prefix: HotPrefix) -> list[str] | None:
    """The replication set of the prompt's popular part, where a policy keeps one."""
    for policy in gateway.models.policies.values():
        members = policy.spread_over(prefix.stride_hashes)
        if members:
            return members
    return None


def _holders(index: PrefixIndex, prefix: HotPrefix) -> list[Holder]:
    """Who holds how much of the latest prompt through ``prefix``, most first."""
    gpu = index.match(prefix.stride_hashes)
    host = index.match_host(prefix.stride_hashes, gpu)
    names = sorted({*gpu, *host}, key=lambda r: (-gpu.get(r, 0), -host.get(r, 0), r))
    return [Holder(name, gpu.get(name, 0), host.get(name, 0)) for name in names]
