"""The load the router counts on each replica, the same way live and in the replayer.

A request loads its replica from dispatch to completion (``outstanding_requests``),
and its predicted uncached prompt tokens load it until its prefill is done, which
the first generated token tells (``outstanding_prefill_tokens``). Every path ends a
request exactly once: finished, failed, or abandoned by its client.

Where the replica reports its own load (several gateways share it), the policy
balances on that report plus this router's requests dispatched after it was made
(:func:`reported`): the report counts every gateway's requests the replica had
received; the requests sent since, only this router knows. Reports and dispatches
are compared on the wall clock, so nodes' clocks should agree (NTP) to within a few
milliseconds; a skew only moves which requests count twice or not at all for the
~50 ms until the next report.
"""

from __future__ import annotations

from replica.api.stats import LoadReport
from router.core import ReplicaState, RoutingRequest
from router.policies import Policy


def dispatched(
    policy: Policy, request: RoutingRequest, replica: ReplicaState, now: float = 0.0
) -> None:
    """``request`` was sent to ``replica`` at ``now`` (wall clock): count its load and
    tell the policy."""
    replica.outstanding_requests += 1
    replica.outstanding_prefills += 1
    replica.outstanding_prefill_tokens += request.predicted_uncached_tokens
    replica.dispatched += 1
    request.prefilling, request.dispatched_at = True, now
    replica.in_flight[request.request_id] = request
    if _since_report(request, replica):
        replica.requests_since_report += 1
        replica.prefill_tokens_since_report += request.predicted_uncached_tokens
    _changed(replica)
    policy.on_dispatch(request, replica)


def prefilled(request: RoutingRequest, replica: ReplicaState) -> None:
    """The prefill is done (or never will be): its tokens leave the replica's queue.
    Idempotent, so every path that ends a request may call it."""
    if request.prefilling:
        request.prefilling = False
        replica.outstanding_prefills -= 1
        replica.outstanding_prefill_tokens -= request.predicted_uncached_tokens
        if _since_report(request, replica):
            replica.prefill_tokens_since_report -= request.predicted_uncached_tokens
        _changed(replica)


def completed(
    policy: Policy,
    request: RoutingRequest,
    replica: ReplicaState,
    cached_tokens: int | None = None,
) -> None:
    """``request`` ended, however it ended: release all its load and tell the policy
    (with the prompt tokens the engine found cached, if it said)."""
    prefilled(request, replica)
    replica.outstanding_requests -= 1
    del replica.in_flight[request.request_id]
    if _since_report(request, replica):
        replica.requests_since_report -= 1
    _changed(replica)
    policy.on_complete(request, replica, cached_tokens)


def reported(replica: ReplicaState, report: LoadReport | None) -> None:
    """The replica's latest load (``None``: it stopped reporting; count our own)."""
    replica.report = report
    replica.free_blocks = report.free_blocks if report is not None else None
    replica.engine_waiting = report.waiting if report is not None else None
    replica.loaded_adapters = report.adapters if report is not None else None
    replica.free_adapter_slots = report.free_adapter_slots if report is not None else None
    since = [r for r in replica.in_flight.values() if _since_report(r, replica)]
    replica.requests_since_report = len(since)
    replica.prefill_tokens_since_report = sum(
        r.predicted_uncached_tokens for r in since if r.prefilling
    )
    _changed(replica)


def changed(replica: ReplicaState) -> None:
    """Its load was set by other means (a test, a benchmark): let the policy re-file it."""
    _changed(replica)


def _changed(replica: ReplicaState) -> None:
    if replica.on_load_change is not None:
        replica.on_load_change(replica)


def _since_report(request: RoutingRequest, replica: ReplicaState) -> bool:
    """Whether the replica's report cannot count ``request`` yet."""
    return replica.report is not None and request.dispatched_at > replica.report.ts
