"""The gateway's Prometheus figures: one histogram observed per request, the rest read
from the accounting, the backends and the queue at scrape time.

Where API keys are configured, the families labelled by backend (they name the fleet's
replicas: its topology) and by tenant are an administrator's to scrape (Prometheus's
``authorization`` in the scrape config); the fleet-wide families stay open to monitoring.
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Callable, Iterable, Mapping

from prometheus_client import CollectorRegistry, ProcessCollector, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

from router.core import OVER_CAUSES
from router.fair.admission import AdmissionQueue
from router.fleet.backends import BackendPool
from router.path.accounting import Accounting, RequestCounts
from router.path.latency import LatencyHistogram
from router.stats import PolicyCounts

#: ``prefix_router_*`` families per (replica, policy), each read from ``PolicyCounts``.
BY_POLICY: tuple[tuple[str, str, Callable[[PolicyCounts], int]], ...] = (
    ("routing_decisions", "Requests routed.", lambda c: c.requests),
    (
        "predicted_cached_tokens",
        "Cached tokens the router predicted.",
        lambda c: c.predicted_cached_tokens,
    ),
    (
        "actual_cached_tokens",
        "Cached tokens the replicas reported.",
        lambda c: c.actual_cached_tokens,
    ),
    (
        "over_predicted_tokens",
        "Cached tokens predicted beyond what the replicas reported.",
        lambda c: c.over_predicted_tokens,
    ),
    (
        "under_predicted_tokens",
        "Cached tokens the replicas reported beyond the prediction.",
        lambda c: c.under_predicted_tokens,
    ),
)
#: ``prefix_router_predictions{outcome}``: predictions against the replicas' figures.
OUTCOMES: tuple[tuple[str, Callable[[PolicyCounts], int]], ...] = (
    ("exact", lambda c: c.exact_predictions),
    ("over", lambda c: c.over_predictions),
    ("under", lambda c: c.under_predictions),
)
#: ``prefix_router_over_predictions{cause}``: the over-predictions by cause.
OVER_CAUSE_COUNTS: tuple[tuple[str, Callable[[PolicyCounts], int]], ...] = tuple(
    (cause, operator.attrgetter(f"over_{cause}")) for cause in OVER_CAUSES
)
#: ``prefix_router_tenant_*`` families, each read from ``RequestCounts``.
BY_TENANT: tuple[tuple[str, str, Callable[[RequestCounts], int]], ...] = (
    ("requests", "Requests per tenant.", lambda c: c.requests),
    ("errors", "Failed requests per tenant.", lambda c: c.errors),
    ("prompt_tokens", "Prompt tokens per tenant.", lambda c: c.prompt_tokens),
    ("cached_tokens", "Prompt tokens found in the cache, per tenant.", lambda c: c.cached_tokens),
)


class GatewayMetrics:
    """The registry ``GET /metrics`` renders."""

    def __init__(
        self,
        accounting: Accounting,
        pool: BackendPool,
        admission: AdmissionQueue,
        footprint: Callable[[], Mapping[str, Mapping[str, int]]] = dict,
    ) -> None:
        self._accounting, self._pool, self._admission = accounting, pool, admission
        self.registry = CollectorRegistry()
        self.registry.register(self)
        ProcessCollector(registry=self.registry)  # memory and CPU of the gateway
        #: Apart: the replicas (their addresses) and who sends what are an
        #: administrator's to see when keys are configured.
        self.admin_registry = CollectorRegistry()
        self.admin_registry.register(BackendMetrics(accounting, pool))
        self.admin_registry.register(TenantMetrics(accounting, footprint))

    def render(self, admin: bool = True) -> bytes:
        """The exposition text; the families by backend and by tenant with ``admin``."""
        text = generate_latest(self.registry)
        return text + generate_latest(self.admin_registry) if admin else text

    def collect(self) -> Iterable[Metric]:
        yield from self._by_policy_totals()
        admission = self._admission
        yield GaugeMetricFamily(
            "prefix_router_queued_requests", "Requests waiting for a free replica.", len(admission)
        )
        yield CounterMetricFamily(
            "prefix_router_refused_requests", "Requests refused with 429.", admission.refused
        )
        yield CounterMetricFamily(
            "prefix_router_unread_prompts",
            "Requests whose prompt the gateway could not read (routed by load alone).",
            self._accounting.unread_prompts,
        )
        yield CounterMetricFamily(
            "prefix_router_session_requests",
            "Requests that carried a session key.",
            self._accounting.session_requests,
        )
        paths = CounterMetricFamily(
            "prefix_router_requests_by_path",
            "Requests by how their KV reached the replica that answered: local, "
            "disaggregated (prefilled on another replica) or pulled (from a peer).",
            labels=["path"],
        )
        for path, count in sorted(self._accounting.paths.items()):
            paths.add_metric([path], count)
        yield paths

    def _by_policy_totals(self) -> Iterable[Metric]:
        """Every request per policy, and its time to first token seen from the gateway."""
        yield from _request_families("policy", self._accounting.policies)
        yield from _request_families("model", self._accounting.models)
        ttft = HistogramMetricFamily(
            "prefix_router_time_to_first_token_seconds",
            "Time from dispatch to the first token, per policy.",
            labels=["policy"],
        )
        for policy, histogram in self._accounting.ttft.items():
            ttft.add_metric([policy], _buckets(histogram), histogram.sum_s)
        yield ttft
        overhead = HistogramMetricFamily(
            "prefix_router_gateway_overhead_seconds",
            "Time from receiving a request to sending it upstream.",
        )
        histogram = self._accounting.overhead
        overhead.add_metric([], _buckets(histogram), histogram.sum_s)
        yield overhead


class BackendMetrics:
    """The families labelled by backend (``replica``: its id, often its URL)."""

    def __init__(self, accounting: Accounting, pool: BackendPool) -> None:
        self._accounting, self._pool = accounting, pool

    def collect(self) -> Iterable[Metric]:
        yield from self._by_policy()
        yield from self._by_replica()
        roles = GaugeMetricFamily(
            "prefix_router_backend_role",
            "Each backend's role in a disaggregated fleet (1 for its role).",
            labels=["replica", "role"],
        )
        for backend in self._pool.backends:
            roles.add_metric([backend.state.replica_id, backend.state.role], 1)
        yield roles

    def _by_policy(self) -> Iterable[Metric]:
        by_backend = self._accounting.by_backend
        names = [b.state.replica_id for b in self._pool.backends]
        for metric, text, read in BY_POLICY:
            family = CounterMetricFamily(
                f"prefix_router_{metric}", text, labels=["replica", "policy"]
            )
            for name in names:
                for policy, counts in by_backend.get(name, {}).items():
                    family.add_metric([name, policy], read(counts))
            yield family
        yield self._per_label(
            "predictions",
            "Cached-token predictions by outcome against the replica's figure.",
            "outcome",
            OUTCOMES,
        )
        yield self._per_label(
            "over_predictions",
            "Predictions over the replica's figure, by cause (router/core.py, OVER_CAUSES).",
            "cause",
            OVER_CAUSE_COUNTS,
        )

    def _per_label(
        self,
        metric: str,
        text: str,
        label: str,
        readers: tuple[tuple[str, Callable[[PolicyCounts], int]], ...],
    ) -> Metric:
        """One family of per-policy counts, each reader's value under its ``label``."""
        family = CounterMetricFamily(
            f"prefix_router_{metric}", text, labels=["replica", "policy", label]
        )
        for backend in self._pool.backends:
            name = backend.state.replica_id
            for policy, counts in self._accounting.by_backend.get(name, {}).items():
                for value, read in readers:
                    family.add_metric([name, policy, value], read(counts))
        return family

    def _by_replica(self) -> Iterable[Metric]:
        errors = self._accounting.upstream_errors
        outstanding = GaugeMetricFamily(
            "prefix_router_outstanding_requests", "Requests in flight.", labels=["replica"]
        )
        failed = CounterMetricFamily(
            "prefix_router_upstream_errors", "Failed upstream calls.", labels=["replica"]
        )
        unkeyed = CounterMetricFamily(
            "prefix_router_unkeyed_event_blocks",
            "Stored blocks of a replica's KV events that could not be keyed.",
            labels=["replica"],
        )
        corrections = CounterMetricFamily(
            "prefix_router_index_corrections",
            "Answers with fewer cached tokens than predicted, by what had said more: the "
            "replica's KV events (they and the engine disagree: its stream is applied "
            "again) or the router's decisions.",
            labels=["replica", "source"],
        )
        precise = GaugeMetricFamily(
            "prefix_router_backend_precise",
            "1 while a replica's cache is known from its KV events, 0 while approximately.",
            labels=["replica", "mode"],
        )
        for backend in self._pool.backends:
            name = backend.state.replica_id
            outstanding.add_metric([name], backend.state.outstanding_requests)
            failed.add_metric([name], errors[name])
            unkeyed.add_metric([name], backend.unkeyed_blocks)
            corrections.add_metric([name, "events"], backend.state.event_disagreements)
            corrections.add_metric([name, "decisions"], backend.state.decision_corrections)
            precise.add_metric([name, backend.routing_mode], int(backend.state.precise))
        yield from (outstanding, failed, unkeyed, corrections, precise)


def _buckets(histogram: LatencyHistogram) -> list[tuple[str, float]]:
    """Prometheus's cumulative buckets of one of the gateway's histograms."""
    cumulative = itertools.accumulate(histogram.counts)
    bounds = [*map(str, histogram.bounds), "+Inf"]
    return list(zip(bounds, cumulative, strict=True))


def _request_families(label: str, counts_by: Mapping[str, RequestCounts]) -> Iterable[Metric]:
    """``prefix_router_<label>_*``: requests, errors and tokens per ``label`` value."""
    for key, text, read in BY_TENANT:
        family = CounterMetricFamily(
            f"prefix_router_{label}_{key}", text.replace("tenant", label), labels=[label]
        )
        for name, counts in counts_by.items():
            family.add_metric([name], read(counts))
        yield family


class TenantMetrics:
    """The ``prefix_router_tenant_*`` families, read from the accounting at scrape time,
    and each tenant's blocks on each replica's GPU (``footprint``: tenant -> replica
    id -> blocks)."""

    def __init__(
        self, accounting: Accounting, footprint: Callable[[], Mapping[str, Mapping[str, int]]]
    ) -> None:
        self._accounting = accounting
        self._footprint = footprint

    def collect(self) -> Iterable[Metric]:
        tenants = self._accounting.tenants
        for key, text, read in BY_TENANT:
            family = CounterMetricFamily(f"prefix_router_tenant_{key}", text, labels=["tenant"])
            for tenant, counts in tenants.items():
                family.add_metric([tenant], read(counts))
            yield family
        blocks = GaugeMetricFamily(
            "prefix_router_tenant_gpu_blocks",
            "Blocks a tenant's prompts hold on a replica's GPU, from its KV events.",
            labels=["tenant", "replica"],
        )
        for tenant, by_replica in self._footprint().items():
            for replica, held in by_replica.items():
                blocks.add_metric([tenant, replica], held)
        yield blocks
