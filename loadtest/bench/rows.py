"""One run's row (DESIGN.md section 7): the statistics before and after it, and the
figures their difference gives."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import httpx
import numpy as np

from loadtest.bench.config import BenchConfig
from loadtest.bench.locust_run import LocustRun
from loadtest.bench.targets import Fleet, engine_figures, gateway_stats, replica_stats
from loadtest.report import ROW_KEYS, Row, goodput_figures, tier_figures
from loadtest.workloads import ChatConfig, workload_kind
from replica.api.figures import EngineFigures
from replica.api.stats import ReplicaStats
from router.path.latency import percentile
from router.stats import GatewayStats


@dataclass(frozen=True)
class Snapshot:
    """The gateways' and the replicas' statistics at one moment (none: not ours), and
    what every replica counted (ours or vLLM: :class:`EngineFigures`), by URL."""

    gateways: list[GatewayStats]
    replicas: list[ReplicaStats]
    engines: dict[str, EngineFigures] = field(default_factory=dict)


def snapshot(client: httpx.Client, fleet: Fleet) -> Snapshot:
    gateways = [gateway_stats(client, url) for url in fleet.gateways] if fleet.ours else []
    replicas = [replica_stats(client, url) for url, config in fleet.replicas.items() if config]
    answered = [g for g in gateways if g]
    return Snapshot(answered, [r for r in replicas if r is not None], engine_figures(client, fleet))


def live_row(
    policy: str,
    config: BenchConfig,
    fleet: Fleet,
    run: LocustRun,
    before: Snapshot,
    after: Snapshot,
) -> Row:
    counted = _engine_counts(before, after)
    per_replica = (
        [r.requests for r in after.replicas]
        or [f.requests for f in counted.values()]
        or _gateway_requests(before, after)
    )
    first = next((c for c in fleet.replicas.values() if c), None)
    row: Row = dict.fromkeys(ROW_KEYS)
    row.update(
        label=policy,
        policy=policy if fleet.ours else None,  # else a label for how the target routes
        workload=config.workload,
        replicas=len(fleet.replicas) if fleet.ours else (len(after.replicas) or None),
        capacity_blocks=first.num_blocks if first else None,
        requests=run.requests,
        failures=run.failures,
        throughput_rps=run.requests / run.elapsed_s,
        imbalance=max(per_replica) / np.mean(per_replica) if sum(per_replica) else None,
        prediction_accuracy=live_prediction_accuracy(before, after, policy),
        **prediction_shares(before, after, policy),
        requests_per_replica=per_replica,
        models=_model_figures(before, after, _adapter_models(config)),
        requests_per_gateway=_requests_per_gateway(before, after),
        **_client_figures(run, config),
    )
    if after.replicas:
        row.update(_hit_figures(after.replicas))
    elif counted:
        row.update(_engine_hit_figures(list(counted.values())))
    else:
        row.update(_client_hit_figures(run.client))
    row.update(_event_latency(after))
    row["pulled_tokens"] = _pulled_tokens(before, after)
    return row


def _pulled_tokens(before: Snapshot, after: Snapshot) -> int | None:
    """Prompt tokens our replicas pulled from one another during the run (``None``:
    none of them is ours)."""
    if not after.replicas:
        return None
    earlier = {r.pid: r.transfers.pulled_tokens for r in before.replicas}
    return sum(r.transfers.pulled_tokens - earlier.get(r.pid, 0) for r in after.replicas)


def _client_figures(run: LocustRun, config: BenchConfig) -> Row:
    """What the clients measured (latencies, exact, from every streamed request) and
    what the run took (its time, the machine's CPUs)."""
    client = run.client
    ttft, e2e = client.get("ttft_s", []), client.get("e2e_s", [])
    gaps = [[(gap, 1) for gap in request] for request in client.get("token_gaps", [])]
    slos = (config.slo_ttft_s, config.slo_itl_s)
    return {
        **(goodput_figures(ttft, gaps, run.elapsed_s, *slos) if len(gaps) == len(ttft) else {}),
        "ttft_p50_s": percentile(ttft, 50),
        "ttft_p90_s": percentile(ttft, 90),
        "ttft_p99_s": percentile(ttft, 99),
        "e2e_p50_s": percentile(e2e, 50),
        "client_token_hit_rate": client.get("client_token_hit_rate"),
        "client_prompt_tokens": client.get("prompt_tokens"),
        "client_cached_tokens": client.get("cached_tokens"),
        "late_session_starts": client.get("late_session_starts"),
        "duration_s": run.elapsed_s,
        "cpu_busy": run.cpu_busy,
        "cpu_busy_peak": run.cpu_busy_peak,
    }


def _event_latency(snap: Snapshot) -> Row:
    """How long the replicas' KV events took to reach the gateways' indexes: the median
    of the streams' medians and the worst stream's p99 (over each gateway's last
    10,000 batches per replica: the transport's figure, not the policy's)."""
    streams = [b.kv_stream for g in snap.gateways for b in g.backends if b.kv_stream]
    p50s = [s.latency_p50_s for s in streams if s.latency_p50_s is not None]
    p99s = [s.latency_p99_s for s in streams if s.latency_p99_s is not None]
    return {
        "kv_event_latency_p50_s": float(np.median(p50s)) if p50s else None,
        "kv_event_latency_p99_s": max(p99s) if p99s else None,
    }


def _hit_figures(replicas: list[ReplicaStats]) -> Row:
    """Hits as the engines counted them (their statistics were reset before the run)."""
    caches = [r.cache for r in replicas]
    prompt, cached = sum(c.query_tokens for c in caches), sum(c.hit_tokens for c in caches)
    blocks = sum(c.query_blocks for c in caches)
    host_hits = sum(c.host_hit_tokens for c in caches)
    to_host, to_gpu = sum(c.bytes_to_host for c in caches), sum(c.bytes_to_gpu for c in caches)
    return {
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "token_hit_rate": cached / prompt if prompt else None,
        "block_hit_rate": sum(c.hit_blocks for c in caches) / blocks if blocks else None,
        "evictions": sum(c.evictions for c in caches),
        **tier_figures(prompt, cached, host_hits, to_host, to_gpu),
    }


def _engine_counts(before: Snapshot, after: Snapshot) -> dict[str, EngineFigures]:
    """What each replica counted during the run (vLLM's counters never reset), when
    every replica answered both times."""
    if not after.engines or set(after.engines) != set(before.engines):
        return {}
    return {url: now.since(before.engines[url]) for url, now in after.engines.items()}


def _engine_hit_figures(counted: list[EngineFigures]) -> Row:
    """Hits as the engines counted them (vLLM: its prefix cache's counters)."""
    prompt, cached = sum(f.query_tokens for f in counted), sum(f.hit_tokens for f in counted)
    return {
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "token_hit_rate": cached / prompt if prompt else None,
    }


def _client_hit_figures(client: dict[str, Any]) -> Row:
    """Not our replicas: the usage blocks the clients read are all there is."""
    return {
        "prompt_tokens": client.get("prompt_tokens"),
        "cached_tokens": client.get("cached_tokens"),
        "token_hit_rate": client.get("client_token_hit_rate"),
    }


def _gateway_requests(before: Snapshot, after: Snapshot) -> list[int]:
    """Requests the gateways sent each replica during the run."""

    def by_replica(snap: Snapshot) -> Counter[str]:
        counts: Counter[str] = Counter()
        for gateway in snap.gateways:  # each gateway counts what it sent
            for backend in gateway.backends:
                counts[backend.replica_id] += backend.dispatched
        return counts

    now, then = by_replica(after), by_replica(before)
    return [now[replica] - then[replica] for replica in sorted(now)]


def _requests_per_gateway(before: Snapshot, after: Snapshot) -> list[int] | None:
    """Requests each of our gateways routed during the run (by process: the gateways
    of one deployment may share a port)."""
    if not after.gateways:
        return None
    then = {g.pid: sum(b.dispatched for b in g.backends) for g in before.gateways}
    return [sum(b.dispatched for b in g.backends) - then.get(g.pid, 0) for g in after.gateways]


#: The prediction figures of a row, each a share of the run's predictions, by the
#: gateway's count (router/stats.py, PolicyCounts) it is made of.
PREDICTION_SHARES = {
    "prediction_exact": "exact_predictions",
    "prediction_within_block": "block_predictions",
    "prediction_over": "over_predictions",
    "prediction_over_pending": "over_pending",
    "prediction_over_evicted": "over_evicted",
    "prediction_over_unexplained": "over_unexplained",
}


def prediction_shares(before: Snapshot, after: Snapshot, policy: str) -> Row:
    """Of this run's predictions: the share the engines' figures matched exactly, those
    within one KV block, and those that predicted more cached tokens than were found,
    in all and by cause (router/core.py, OVER_CAUSES)."""
    if not before.gateways or not after.gateways:
        return dict.fromkeys(PREDICTION_SHARES)

    def counts(snap: Snapshot) -> list[int]:
        every = [c for g in snap.gateways for c in g.by_policy(policy)]
        fields = ("predictions", *PREDICTION_SHARES.values())
        return [sum(getattr(c, name) for c in every) for name in fields]

    made, *shares = (now - then for now, then in zip(counts(after), counts(before), strict=True))
    return {
        key: share / made if made > 0 else None
        for key, share in zip(PREDICTION_SHARES, shares, strict=True)
    }


def live_prediction_accuracy(before: Snapshot, after: Snapshot, policy: str) -> float | None:
    """Share of this run's predictions within one router stride of the engine's figure."""
    if not before.gateways or not after.gateways:
        return None

    def counts(snap: Snapshot) -> tuple[int, int]:
        every = [c for g in snap.gateways for c in g.by_policy(policy)]
        return sum(c.predictions for c in every), sum(c.close_predictions for c in every)

    (made_then, close_then), (made_now, close_now) = counts(before), counts(after)
    made = made_now - made_then
    return (close_now - close_then) / made if made > 0 else None


def _adapter_models(config: BenchConfig) -> dict[str, str]:
    """The chat workload's adapters, each with the model it sits on."""
    if not workload_kind(config.workload).chat:
        return {}
    chat = ChatConfig(**config.chat_config())
    return {adapter: chat.model_names[0] for adapter in chat.adapter_names}


def _model_figures(
    before: Snapshot, after: Snapshot, adapter_models: dict[str, str]
) -> dict[str, Row]:
    """Per model the gateways saw named during the run, a model's adapters together
    (as the replay reports them): requests and the token hit rate the replicas
    reported ({} where no request named a model)."""
    totals: dict[str, Counter[str]] = {}
    for snap, sign in ((after, 1), (before, -1)):
        for gateway in snap.gateways:
            for name, counts in gateway.models.items():
                base = adapter_models.get(name)
                total = totals.setdefault(f"{base} adapters" if base else name, Counter())
                total["requests"] += sign * counts.requests
                total["prompt"] += sign * counts.prompt_tokens
                total["cached"] += sign * counts.cached_tokens
    figures = {}
    for name, t in sorted(totals.items()):
        if t["requests"]:
            rate = t["cached"] / t["prompt"] if t["prompt"] else None
            figures[name] = {"requests": t["requests"], "token_hit_rate": rate}
    return figures
