"""What the gateway counts: load per replica, and requests per policy, backend and tenant.

One object owns every counter the gateway keeps, updates them on the three events
of a request's life (dispatched, first token, ended) and builds ``/stats`` from
them; the Prometheus metrics read the same counters at scrape time.
"""

from __future__ import annotations

import os
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass, replace

from router.config import GatewayConfig
from router.core import ReplicaState, RoutingRequest
from router.fair.admission import AdmissionQueue
from router.fleet import load
from router.fleet.backends import Backend, BackendPool
from router.path.latency import LatencyHistogram, percentile, quantile
from router.policies import Policy
from router.stats import (
    BackendStats,
    GatewayStats,
    KVStreamStats,
    PolicyCounts,
    PolicyStats,
    TenantStats,
)

#: The gateway's own time per request, in seconds: a tenth of a millisecond to 50 ms.
OVERHEAD_BUCKETS = (1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 5e-2)


@dataclass
class RequestCounts:
    requests: int = 0
    errors: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0

    def stats(self) -> TenantStats:
        rate = self.cached_tokens / self.prompt_tokens if self.prompt_tokens else None
        return TenantStats(self.requests, self.errors, self.prompt_tokens, self.cached_tokens, rate)


class Accounting:
    """The gateway's counters. ``tolerance_tokens``: a prediction within this many
    cached tokens of the replica's figure counts as close (one router stride);
    ``block_tokens``: the fleet's KV block."""

    def __init__(
        self,
        tolerance_tokens: int,
        wall_clock: Callable[[], float] = time.time,
        block_tokens: int = 16,
    ) -> None:
        self.tolerance_tokens = tolerance_tokens
        self.block_tokens = block_tokens
        self._wall_clock = wall_clock  # dispatch times, compared with replicas' reports
        #: replica id -> policy name -> counts.
        self.by_backend: defaultdict[str, defaultdict[str, PolicyCounts]] = defaultdict(
            lambda: defaultdict(PolicyCounts)
        )
        self.upstream_errors: Counter[str] = Counter()
        self.tenants: defaultdict[str, RequestCounts] = defaultdict(RequestCounts)
        self.totals = RequestCounts()  # every request, with a tenant or not
        #: Per policy (it can be switched while the gateway runs): requests and cached
        #: tokens, and the time from dispatch to the first token.
        self.policies: defaultdict[str, RequestCounts] = defaultdict(RequestCounts)
        #: Per model or adapter named (a fleet may serve several).
        self.models: defaultdict[str, RequestCounts] = defaultdict(RequestCounts)
        self.ttft: defaultdict[str, LatencyHistogram] = defaultdict(LatencyHistogram)
        #: The time from receiving a request to sending it upstream.
        self.overhead = LatencyHistogram(OVERHEAD_BUCKETS)
        self.retries = 0
        #: Requests whose prompt the gateway could not read (routed by load alone).
        self.unread_prompts = 0
        #: Requests that carried a session key (``--session-key``).
        self.session_requests = 0
        #: Requests by how their KV got to the replica that answered: ``local``,
        #: ``disaggregated`` (prefilled on another replica) or ``pulled`` (from a peer).
        self.paths: Counter[str] = Counter()
        #: Disaggregated requests past their prefill leg: its cached tokens (what the
        #: request's hit rate counts) and when the leg was dispatched (its TTFT's start).
        self._prefilled: dict[str, tuple[int | None, float]] = {}

    def dispatched(self, request: RoutingRequest, replica: ReplicaState, policy: Policy) -> None:
        load.dispatched(policy, request, replica, self._wall_clock())
        self.by_backend[replica.replica_id][policy.name].requests += 1

    def first_token(self, request: RoutingRequest, replica: ReplicaState, policy: Policy) -> None:
        if request.prefilling:  # the first time only: later calls are no-ops
            started = self._prefilled.get(request.request_id, (None, request.dispatched_at))[1]
            self.ttft[policy.name].observe(self._wall_clock() - started)
        load.prefilled(request, replica)

    def prefill_ended(
        self,
        request: RoutingRequest,
        replica: ReplicaState,
        policy: Policy,
        cached: int | None,
        failed: bool,
    ) -> None:
        """A disaggregated request's prefill leg ended: its load leaves the prefill
        replica, whose cached tokens are the request's (the decode replica pulls them)."""
        started = request.dispatched_at
        load.completed(policy, request, replica, cached)
        if failed:
            self.upstream_errors[replica.replica_id] += 1
        else:
            self._predicted(request, replica, policy, cached)
        self._prefilled[request.request_id] = (cached, started)

    def ended(
        self,
        request: RoutingRequest,
        replica: ReplicaState,
        policy: Policy,
        cached: int | None,
        failed: bool,
    ) -> None:
        """The request ended (``cached``: the tokens the replica reported, if it did)."""
        load.completed(policy, request, replica, cached)
        if failed:
            self.upstream_errors[replica.replica_id] += 1
        self.paths[request.kv.path if request.kv is not None else "local"] += 1
        prefilled = self._prefilled.pop(request.request_id, None)
        if prefilled is not None:  # its prompt's hits were the prefill leg's, counted there
            self._count_request(request, policy.name, prefilled[0], failed)
            return
        self._count_request(request, policy.name, cached, failed)
        self._predicted(request, replica, policy, cached)

    def _predicted(
        self, request: RoutingRequest, replica: ReplicaState, policy: Policy, cached: int | None
    ) -> None:
        """Count how close the policy's prediction came to the replica's figure."""
        if cached is not None and request.predicted_cached_tokens is not None:
            counts = self.by_backend[replica.replica_id][policy.name]
            counts.predicted(
                request.predicted_cached_tokens,
                cached,
                self.block_tokens,
                self.tolerance_tokens,
                request.over_cause,
            )

    def _count_request(
        self, request: RoutingRequest, policy: str, cached: int | None, failed: bool
    ) -> None:
        """Count an ended request in the totals and per policy, tenant and model."""
        prompt = request.num_prompt_tokens
        self._count(self.totals, prompt, cached, failed)
        self._count(self.policies[policy], prompt, cached, failed)
        if request.tenant is not None:
            self._count(self.tenants[request.tenant], prompt, cached, failed)
        model = request.adapter or request.model
        if model is not None:
            self._count(self.models[model], prompt, cached, failed)

    @staticmethod
    def _count(counts: RequestCounts, prompt: int, cached: int | None, failed: bool) -> None:
        counts.requests += 1
        counts.errors += failed
        if cached is not None:
            counts.prompt_tokens += prompt
            counts.cached_tokens += cached

    def stats(
        self,
        policy: str,
        config: GatewayConfig,
        pool: BackendPool,
        admission: AdmissionQueue,
        footprint: dict[str, dict[str, int]] | None = None,
    ) -> GatewayStats:
        footprint = footprint or {}
        return GatewayStats(
            policy=policy,
            retries=self.retries,
            unread_prompts=self.unread_prompts,
            session_requests=self.session_requests,
            refused=admission.refused,
            queued=len(admission),
            config=config,
            backends=[self._backend_stats(backend) for backend in pool.backends],
            tenants={
                name: replace(
                    counts.stats(),
                    charged_tokens=admission.fair.charged_tokens.get(name, 0),
                    gpu_blocks=footprint.get(name, {}),
                )
                for name, counts in self.tenants.items()
            },
            totals=self.totals.stats(),
            pid=os.getpid(),
            policies={name: self._policy_stats(name) for name in self.policies},
            models={name: counts.stats() for name, counts in self.models.items()},
            paths=dict(self.paths),
        )

    def _policy_stats(self, name: str) -> PolicyStats:
        counts = self.policies[name].stats()
        ttft = self.ttft.get(name)
        p50, p90 = (quantile(ttft.bounds, ttft.counts, q) if ttft else None for q in (0.5, 0.9))
        return PolicyStats(
            counts.requests,
            counts.errors,
            counts.prompt_tokens,
            counts.cached_tokens,
            counts.token_hit_rate,
            ttft.count if ttft else 0,
            p50,
            p90,
        )

    def _backend_stats(self, backend: Backend) -> BackendStats:
        state = backend.state
        by_policy: dict[str, PolicyCounts] = self.by_backend.get(state.replica_id, {})
        return BackendStats(
            url=backend.url,
            replica_id=state.replica_id,
            data_parallel_rank=backend.dp_rank,
            server=backend.server,
            dispatched=state.dispatched,
            outstanding_requests=state.outstanding_requests,
            outstanding_prefill_tokens=state.outstanding_prefill_tokens,
            by_policy={name: replace(counts) for name, counts in by_policy.items()},
            upstream_errors=self.upstream_errors[state.replica_id],
            kv_events=backend.events_supported,
            healthy=backend.healthy,
            kv_stream=_stream_stats(backend),
            load_requests=state.load_requests,
            load_prefill_tokens=state.load_prefill_tokens,
            free_blocks=state.free_blocks,
            engine_waiting=state.engine_waiting,
            max_num_seqs=state.max_num_seqs,
            routing_mode=backend.routing_mode,
            approximate_reason=backend.approximate_reason,
            unchecked=list(backend.unchecked),
            unkeyed_blocks=backend.unkeyed_blocks,
            event_disagreements=state.event_disagreements,
            decision_corrections=state.decision_corrections,
            engine=backend.card.engine if backend.card else None,
            model=backend.card.model if backend.card else None,
            block_size=backend.card.block_size if backend.card else None,
            draining=backend.draining,
            role=state.role,
        )


def _stream_stats(backend: Backend) -> KVStreamStats | None:
    state = backend.stream
    if state is None:
        return None
    latencies = list(state.latencies)
    return KVStreamStats(
        state.endpoint.endpoint,
        state.batches,
        state.gaps,
        state.replayed,
        state.resyncs,
        state.stale,
        percentile(latencies, 50),
        percentile(latencies, 99),
        state.indexed_through,
        state.restarts,
    )
