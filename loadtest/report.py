"""Figures of a run as rows of one shape (DESIGN.md section 7), and their tables.

Every report, offline or live, is a list of rows with the same keys, so any two
runs can be compared. A figure that a run cannot know is ``None``, never made up.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from loadtest.replay import ReplayResult, RequestRecord
from router.fair.fairness import PRIORITIES
from router.path.latency import percentile

Row = dict[str, Any]

#: The row's keys, in table order (more may follow; these are never renamed).
ROW_KEYS = (
    "label",
    "policy",
    "workload",
    "replicas",
    "capacity_blocks",
    "requests",
    "failures",
    "prompt_tokens",
    "cached_tokens",
    "token_hit_rate",
    "block_hit_rate",
    "evictions",
    "ttft_p50_s",
    "ttft_p90_s",
    "ttft_p99_s",
    "e2e_p50_s",
    "throughput_rps",
    "imbalance",
    "prediction_accuracy",
)


def replay_row(result: ReplayResult, label: str | None = None) -> Row:
    """The figures of one replay; engine statistics for hits, records for latency."""
    records = result.records
    done = [r for r in records if r.finish_s is not None]
    ttfts = ttft_values(result)
    e2e = [r.finish_s - r.arrival_s for r in done if r.finish_s is not None]
    stats = [engine.cache_stats for engine in result.engines]
    # per request, not per engine: a disaggregated request queries two engines
    query_tokens = sum(r.prompt_tokens for r in done)
    hit_tokens = sum(r.cached_tokens for r in done)
    query_blocks = sum(s.query_blocks for s in stats)
    dispatched = np.array(result.dispatched or [0])
    return {
        "label": label or result.policy,
        "policy": result.policy,
        "workload": result.workload,
        "replicas": result.config.replicas,
        "capacity_blocks": result.config.capacity_blocks,
        "requests": len(records),
        "failures": sum(r.error is not None for r in records),
        "prompt_tokens": query_tokens,
        "cached_tokens": hit_tokens,
        "token_hit_rate": hit_tokens / query_tokens if query_tokens else None,
        "block_hit_rate": sum(s.hit_blocks for s in stats) / query_blocks if query_blocks else None,
        "evictions": sum(s.evictions for s in stats),
        "ttft_p50_s": percentile(ttfts, 50),
        "ttft_p90_s": percentile(ttfts, 90),
        "ttft_p99_s": percentile(ttfts, 99),
        "e2e_p50_s": percentile(e2e, 50),
        "throughput_rps": len(done) / result.duration_s if result.duration_s else None,
        "imbalance": float(dispatched.max() / dispatched.mean()) if dispatched.sum() else None,
        "prediction_accuracy": replay_prediction_accuracy(
            done, result.config.routing.stride_tokens
        ),
        **latency_figures(done, result),
        **transfer_figures(records, result),
        "prefill_tokens_computed": sum(int(e.prefill_tokens_computed) for e in result.engines),
        "prefill_tokens_saved": hit_tokens,
        **tier_figures(
            query_tokens,
            hit_tokens,
            sum(s.host_hit_tokens for s in stats),
            sum(e.bytes_to_host for e in result.engines),
            sum(e.bytes_to_gpu for e in result.engines),
        ),
        "preemptions": sum(e.scheduler.num_preemptions for e in result.engines),
        "shared_prefix_evictions": result.shared_prefix_evictions,
        "shared_prefix_hit_rate": _shared_prefix_hit_rate(done, result.config.block_size),
        "requests_per_replica": [int(n) for n in dispatched],
        "duration_s": result.duration_s,
        "replica_hours": result.replica_hours,
        "replicas_peak": max((n for _, n in result.fleet_sizes), default=result.config.replicas),
        "fleet_sizes": [[t, n] for t, n in result.fleet_sizes] if result.scale_events else None,
        **_pool_figures(result),
        "hot_sets": hot_set_figures(result.hot_set_changes),
        **adapter_figures(result),
        "models": model_figures(done),
        **tenant_figures(records),
    }


#: One request's inter-token latencies: (seconds, tokens) pairs.
Gaps = Sequence[tuple[float, int]]


def latency_figures(done: Sequence[RequestRecord], result: ReplayResult) -> Row:
    """Inter-token latency and goodput of a replay's finished requests."""
    config = result.config
    ttfts = [r.first_token_s - r.arrival_s if r.first_token_s is not None else None for r in done]
    gaps = [r.token_gaps for r in done]
    return goodput_figures(ttfts, gaps, result.duration_s, config.slo_ttft_s, config.slo_itl_s)


def goodput_figures(
    ttfts: Sequence[float | None],
    gaps: Sequence[Gaps],
    duration_s: float,
    slo_ttft_s: float,
    slo_itl_s: float,
) -> Row:
    """Inter-token latency over every token, and the goodput: the requests a second
    that met both objectives (their TTFT, and the 99th percentile of their own ITL);
    ``ttfts[i]`` and ``gaps[i]`` are request ``i``'s, replayed or live."""
    every = [gap for request in gaps for gap in request]
    values, weights = [g for g, _ in every], [n for _, n in every]
    good = sum(
        ttft is not None and ttft <= slo_ttft_s and _itl_p99(request) <= slo_itl_s
        for ttft, request in zip(ttfts, gaps, strict=True)
    )
    return {
        "itl_p50_s": weighted_percentile(values, weights, 50),
        "itl_p99_s": weighted_percentile(values, weights, 99),
        "goodput_rps": good / duration_s if duration_s else None,
        "slo_attainment": good / len(ttfts) if ttfts else None,
    }


def _itl_p99(gaps: Gaps) -> float:
    """The 99th percentile of one request's inter-token latencies (0: one token)."""
    return weighted_percentile([g for g, _ in gaps], [n for _, n in gaps], 99) or 0.0


def weighted_percentile(
    values: Sequence[float], weights: Sequence[int] = (), q: float = 50
) -> float | None:
    """The ``q``-th percentile of ``values``, each counted ``weights`` times (the
    lower value at a boundary, as for tokens); ``None`` for no values."""
    if not len(values):
        return None
    order = np.argsort(values)
    cumulative = np.cumsum(np.asarray(weights, dtype=float)[order])
    at = np.searchsorted(cumulative, q / 100 * cumulative[-1])
    return float(np.asarray(values)[order][min(at, len(values) - 1)])


def transfer_figures(records: Sequence[RequestRecord], result: ReplayResult) -> Row:
    """KV that moved: the share of requests disaggregated or pulled, the pulls that fell
    back, and the pulls' count, bytes and link seconds."""
    transfers = [engine.transfers for engine in result.engines]
    pulls = sum(t.pulls for t in transfers)
    kv_bytes = result.engines[0].cost.kv_bytes_per_token if result.engines else 0
    duration, count = result.duration_s, len(records)
    return {
        "pd": result.config.pd,
        "disaggregated_share": sum(r.path == "disaggregated" for r in records) / count
        if count
        else None,
        "pulled_share": sum(r.path == "pulled" for r in records) / count if count else None,
        "pull_fallbacks": sum(r.pull_fallback for r in records),
        "pulls": pulls,
        "pulls_per_second": pulls / duration if duration else None,
        "pulled_gb": sum(t.pulled_tokens for t in transfers) * kv_bytes / 1e9,
        "pull_s": sum(t.pull_s for t in transfers),
        "hold_timeouts": sum(t.hold_timeouts for t in transfers),
    }


def hot_set_figures(changes: Sequence[tuple[float, int, int]]) -> dict[str, Row] | None:
    """Each hot prefix's replication set over the run: its sizes over time and the
    largest (``None``: the policy keeps no sets)."""
    if not changes:
        return None
    sets: dict[str, Row] = {}
    for at, key, size in changes:
        figures = sets.setdefault(f"{key:016x}", {"sizes": [], "largest": 1})
        figures["sizes"].append([at, size])
        figures["largest"] = max(figures["largest"], size)
    return sets


def adapter_figures(result: ReplayResult) -> Row:
    """LoRA adapters copied into GPU slots, in all and per minute of the run."""
    loads = sum(engine.adapters.loads for engine in result.engines)
    minutes = result.duration_s / 60
    return {"adapter_loads": loads, "adapter_loads_per_min": loads / minutes if minutes else None}


def model_figures(done: Sequence[RequestRecord]) -> dict[str, Row]:
    """Per model asked for, its adapters' requests together apart from its own:
    requests, token hit rate and TTFT (``{}`` where no request named a model)."""
    by_model: dict[str, list[RequestRecord]] = {}
    for record in done:
        if record.model is not None:
            key = f"{record.model} adapters" if record.adapter else record.model
            by_model.setdefault(key, []).append(record)
    figures = {}
    for name in sorted(by_model):
        records = by_model[name]
        prompt = sum(r.prompt_tokens for r in records)
        ttfts = [r.first_token_s - r.arrival_s for r in records if r.first_token_s is not None]
        figures[name] = {
            "requests": len(records),
            "token_hit_rate": sum(r.cached_tokens for r in records) / prompt if prompt else None,
            "ttft_p50_s": percentile(ttfts, 50),
            "ttft_p99_s": percentile(ttfts, 99),
        }
    return figures


MODEL_KEYS = ("label", "model", "requests", "token_hit_rate", "ttft_p50_s", "ttft_p99_s")


def tenant_figures(records: Sequence[RequestRecord]) -> Row:
    """Per tenant: requests, token hit rate, TTFT and the wait in the router's queue;
    and Jain's index of how fairly the fleet served them (``{}``: no tenants)."""
    by_tenant: dict[str, list[RequestRecord]] = {}
    for record in records:
        if record.tenant is not None and record.finish_s is not None:
            by_tenant.setdefault(record.tenant, []).append(record)
    if not by_tenant:
        return {}
    figures = {}
    for name in sorted(by_tenant):
        done = by_tenant[name]
        prompt = sum(r.prompt_tokens for r in done)
        ttfts = [r.first_token_s - r.arrival_s for r in done if r.first_token_s is not None]
        waits = [r.dispatched_s - r.arrival_s for r in done]
        figures[name] = {
            "requests": len(done),
            "priority": PRIORITIES[done[0].priority],
            "token_hit_rate": sum(r.cached_tokens for r in done) / prompt if prompt else None,
            "ttft_p50_s": percentile(ttfts, 50),
            "ttft_p99_s": percentile(ttfts, 99),
            "queue_wait_p99_s": percentile(waits, 99),
            "service_tokens": sum(_service(r) for r in done),
        }
    return {"tenants": figures, "jain_fairness": jain_fairness(records)}


def _service(record: RequestRecord) -> int:
    """What the fleet spent on a request: its uncached prompt tokens and its output."""
    return record.prompt_tokens - record.cached_tokens + record.output_tokens


def jain_fairness(records: Sequence[RequestRecord], window_s: float = 5.0) -> float | None:
    """Jain's index, (sum x)^2 / (n sum x^2), of each tenant's service over its max-min
    fair share of it (1: every tenant got its fair share; 1/n: one got everything), the
    mean over the windows of ``window_s`` in which the fleet was contended.

    A replay runs until every request is served, so totals say nothing: what counts is
    who was served while requests waited. In each window a tenant's demand is the
    service (uncached prompt and output tokens) of its requests waiting in it (arrived
    before its end, not dispatched before its start); its service, that of its requests
    dispatched in it. The window is contended when the demand exceeds the service
    given; fair shares divide that service by water filling: no tenant more than it
    asked, the rest evenly. ``None``: fewer than two tenants, or never contended."""
    done = [r for r in records if r.tenant is not None and r.finish_s is not None]
    tenants = sorted({r.tenant for r in done if r.tenant is not None})
    if len(tenants) < 2:
        return None
    column = {t: i for i, t in enumerate(tenants)}
    tenant = np.array([column[r.tenant] for r in done if r.tenant is not None])
    arrival = np.array([r.arrival_s for r in done])
    dispatch = np.array([r.dispatched_s for r in done])
    cost = np.array([_service(r) for r in done], dtype=float)
    indices = []
    for start in np.arange(0.0, float(dispatch.max()), window_s):
        end = start + window_s
        waiting = (arrival < end) & (dispatch >= start)
        served = (dispatch >= start) & (dispatch < end)
        demand = np.bincount(tenant[waiting], cost[waiting], len(tenants))
        service = np.bincount(tenant[served], cost[served], len(tenants))
        if demand.sum() <= service.sum() * 1.01 or not service.sum():
            continue  # not contended: everyone got what it asked
        shares = np.array(max_min_shares(list(demand), float(service.sum())))
        x = service[shares > 0] / shares[shares > 0]
        indices.append(x.sum() ** 2 / (len(x) * (x**2).sum()))
    return float(np.mean(indices)) if indices else None


def max_min_shares(demands: Sequence[float], total: float) -> list[float]:
    """``total`` divided max-min fairly among ``demands`` (water filling)."""
    shares = [0.0] * len(demands)
    left, open_ = total, sorted(range(len(demands)), key=lambda i: demands[i])
    while open_:
        even = left / len(open_)
        smallest = open_[0]
        if demands[smallest] > even:
            for i in open_:
                shares[i] = even
            return shares
        shares[smallest] = demands[smallest]
        left -= demands[smallest]
        open_.pop(0)
    return shares


TENANT_KEYS = (
    "label",
    "tenant",
    "priority",
    "requests",
    "token_hit_rate",
    "ttft_p50_s",
    "ttft_p99_s",
    "queue_wait_p99_s",
    "service_tokens",
)


def tenant_rows(rows: Sequence[Row]) -> list[Row]:
    """One row per (run, tenant), for the per-tenant table."""
    return [
        {"label": row["label"], "tenant": name, **figures}
        for row in rows
        for name, figures in (row.get("tenants") or {}).items()
    ]


def model_rows(rows: Sequence[Row]) -> list[Row]:
    """One row per (run, model named), for the per-model table."""
    return [
        {"label": row["label"], "model": name, **figures}
        for row in rows
        for name, figures in (row.get("models") or {}).items()
    ]


def tier_figures(
    query_tokens: int, hit_tokens: int, host_hit_tokens: int, bytes_to_host: int, bytes_to_gpu: int
) -> Row:
    """Hits split by tier: found on the GPU, loaded from the host, and the recomputed rest."""
    rate = (lambda tokens: tokens / query_tokens) if query_tokens else (lambda tokens: None)
    return {
        "gpu_hit_tokens": hit_tokens - host_hit_tokens,
        "host_hit_tokens": host_hit_tokens,
        "recomputed_tokens": query_tokens - hit_tokens,
        "gpu_hit_rate": rate(hit_tokens - host_hit_tokens),
        "host_hit_rate": rate(host_hit_tokens),
        "bytes_to_host": bytes_to_host,
        "bytes_to_gpu": bytes_to_gpu,
    }


def ttft_values(result: ReplayResult) -> list[float]:
    return [
        r.first_token_s - r.arrival_s
        for r in result.records
        if r.first_token_s is not None and r.finish_s is not None
    ]


def replay_prediction_accuracy(done: Sequence[RequestRecord], tolerance: int) -> float | None:
    """Share of requests whose predicted cached tokens came within one stride of the
    engine's figure (the router sees prefixes in strides); ``None`` if nothing predicted."""
    predicted = [r for r in done if r.predicted_cached_tokens is not None]
    if not predicted:
        return None
    close = sum(abs(r.predicted_cached_tokens - r.cached_tokens) < tolerance for r in predicted)  # type: ignore[operator]
    return close / len(predicted)


def _pool_figures(result: ReplayResult) -> Row:
    """A scaling P/D fleet's pools: each one's peak and its size over the run."""
    if not (result.scale_events and result.pool_sizes):
        return {}
    pools = result.pool_sizes
    return {
        **{f"{role}_peak": max(n for _, n in sizes) for role, sizes in pools.items()},
        "pool_sizes": {role: [[t, n] for t, n in sizes] for role, sizes in pools.items()},
    }


def _shared_prefix_hit_rate(done: Sequence[RequestRecord], block_size: int) -> float | None:
    """Share of requests that found their whole shared prefix (system prompt) cached."""
    shared = [r for r in done if r.shared_prefix_tokens]
    if not shared:
        return None
    whole = sum(
        r.cached_tokens >= r.shared_prefix_tokens // block_size * block_size for r in shared
    )
    return whole / len(shared)


def reference_row(
    label: str, template: Row, prompt_tokens: int, cached_tokens: int, **figures: Any
) -> Row:
    """A row for a bound (such as ``infinite_cache``): unknown figures are ``None``."""
    row: Row = dict.fromkeys(template)
    row.update(
        label=label,
        policy=None,
        workload=template["workload"],
        replicas=template["replicas"],
        capacity_blocks=template["capacity_blocks"],
        requests=template["requests"],
        failures=0,
        prompt_tokens=prompt_tokens,
        cached_tokens=cached_tokens,
        token_hit_rate=cached_tokens / prompt_tokens if prompt_tokens else None,
    )
    row.update(figures)
    return row


def _cell(value: Any, key: str) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        percent = ("prediction_accuracy", "cpu_busy", "cpu_busy_peak", "slo_attainment")
        if key.endswith(("_rate", "_share")) or key in percent:
            return f"{value:.1%}"
        if key.endswith("_s"):
            return f"{value * 1000:.0f}ms" if value < 10 else f"{value:.1f}s"
        return f"{value:.2f}"
    return str(value)


def format_table(rows: Sequence[Row], keys: Sequence[str]) -> str:
    """A plain-text table (also valid Markdown) of ``keys`` for every row."""
    cells = [[_cell(row.get(k), k) for k in keys] for row in rows]
    widths = [max(len(k), *(len(c[i]) for c in cells)) for i, k in enumerate(keys)]

    def line(values: Sequence[str]) -> str:
        return "| " + " | ".join(v.rjust(w) for v, w in zip(values, widths, strict=True)) + " |"

    rule = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(keys), rule, *(line(c) for c in cells)])


def write_json(path: str | Path, rows: Sequence[Row], meta: dict[str, Any]) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps({"rows": list(rows), "meta": meta}, indent=2) + "\n")


def command_line() -> str:
    return " ".join(["prefix-router", *sys.argv[1:]])


def version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("prefix-router")
    except PackageNotFoundError:
        return "unknown"
