"""Stage 4 of the request path: place a request on one replica, and record it there.

The request's model's policy chooses among the admitted replicas that its tenant's
cache budget allows (``router/fair/cache_budget.py``); the choice is recorded at once,
in the replica's load and the policy's state (``Accounting.dispatched``) and in the
tenant's service (``FairShare.dispatched``, corrected when it ends). The policy may
plan how the request's KV gets there (``RoutingRequest.kv``): prefilled on another
replica first (its load is then recorded there, the decode replica's once the prefill
is done: ``router/path/dispatch.py``), or its prefix pulled from a peer.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from router.core import ReplicaState, RoutingRequest
from router.fair.cache_budget import within_budget
from router.fair.fairness import FairShare
from router.fair.tenants import SaltBook
from router.fleet.backends import Backend, BackendPool
from router.fleet.models import ModelRoutes
from router.path.accounting import Accounting
from router.policies import Policy


class Placement(NamedTuple):
    """Where a request goes, the policy that sent it there, and where its KV comes
    from: a ``prefill`` replica (disaggregated), or a peer it pulls from."""

    backend: Backend
    policy: Policy
    prefill: Backend | None = None
    pull_from: Backend | None = None


class Placer:
    """Places one gateway's requests with its models' policies."""

    def __init__(
        self,
        models: ModelRoutes,
        pool: BackendPool,
        salts: SaltBook,
        accounting: Accounting,
        fair: FairShare,
    ) -> None:
        self.models, self.pool, self.salts = models, pool, salts
        self.accounting, self.fair = accounting, fair

    def place(self, request: RoutingRequest, candidates: Sequence[ReplicaState]) -> Placement:
        policy = self.models.policy(request.model)
        allowed = self.within_budget(policy, request, candidates)
        request.kv = None  # planned anew by the policy, at every try
        backend = self.pool.by_state(policy.choose(request, allowed))
        plan, prefill, pull_from = request.kv, None, None
        if plan is not None and plan.prefill is not None:
            prefill = self.pool.by_state(plan.prefill)
        elif plan is not None and plan.pull_from is not None:
            pull_from = self.pool.by_state(plan.pull_from)
        self.accounting.dispatched(request, (prefill or backend).state, policy)
        self.fair.dispatched(request)
        return Placement(backend, policy, prefill, pull_from)

    def within_budget(
        self, policy: Policy, request: RoutingRequest, candidates: Sequence[ReplicaState]
    ) -> Sequence[ReplicaState]:
        """The candidates a request of a tenant with a cache budget may go to."""
        if request.cache_budget is None or request.tenant is None:
            return candidates
        salts = self.salts.salts_of(request.tenant)
        return within_budget(policy, request, candidates, salts)
