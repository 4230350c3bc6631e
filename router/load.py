"""The load the router counts on each replica, the same way live and in the replayer.

A request loads its replica from dispatch to completion (``outstanding_requests``),
and its predicted uncached prompt tokens load it until its prefill is done, which
the first generated token tells (``outstanding_prefill_tokens``). Every path ends a
request exactly once: finished, failed, or abandoned by its client.
"""

from __future__ import annotations

from router.policies import Policy, ReplicaState, RoutingRequest


def dispatched(policy: Policy, request: RoutingRequest, replica: ReplicaState) -> None:
    """``request`` was sent to ``replica``: count its load and tell the policy."""
    replica.outstanding_requests += 1
    replica.outstanding_prefill_tokens += request.predicted_uncached_tokens
    replica.dispatched += 1
    request.prefilling = True
    policy.on_dispatch(request, replica)


def prefilled(request: RoutingRequest, replica: ReplicaState) -> None:
    """The prefill is done (or never will be): its tokens leave the replica's queue.
    Idempotent, so every path that ends a request may call it."""
    if request.prefilling:
        request.prefilling = False
        replica.outstanding_prefill_tokens -= request.predicted_uncached_tokens


def completed(policy: Policy, request: RoutingRequest, replica: ReplicaState) -> None:
    """``request`` ended, however it ended: release all its load and tell the policy."""
    prefilled(request, replica)
    replica.outstanding_requests -= 1
    policy.on_complete(request, replica)
