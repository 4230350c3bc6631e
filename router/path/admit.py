"""Stage 3 of the request path: admit a request once a replica of its model has a slot
for it.

Which replicas have a slot is ``router/fair/slots.py``'s rule (the cap, the reserve
for lighter tenants, engines' own queues for a tenant beyond its share, a light
tenant's home); when none has, the request waits in the fair queue
(``router/fair/admission.py``) for its turn, or is refused with 429. Out come the
replicas it may be placed on.
"""

from __future__ import annotations

from router.config import GatewayConfig
from router.core import ReplicaState, RoutingRequest
from router.fair.admission import AdmissionQueue
from router.fair.slots import with_free_slot
from router.fleet.backends import BackendPool
from router.fleet.models import ModelRoutes, ServedName


class Admitter:
    """Admits one gateway's requests to its pool's replicas, through its ``queue``."""

    def __init__(
        self,
        config: GatewayConfig,
        queue: AdmissionQueue,
        pool: BackendPool,
        models: ModelRoutes,
    ) -> None:
        self.config, self.queue, self.pool, self.models = config, queue, pool, models
        # A freed slot wakes only a waiting request that could take it: this stage
        # knows which replicas have a slot for whom.
        queue.can_serve = lambda request: bool(self.available(request))

    async def admit(self, request: RoutingRequest) -> list[ReplicaState]:
        """The replicas of the request's model with a free slot, once its turn has
        come; raises :class:`~router.fair.admission.Overloaded` when the queue is full
        or too slow."""
        queue = self.queue
        # None waits, or this tenant is within its share: a free slot is one the waiting
        # could not take (the reserve), or is about to be taken (one is woken for it).
        if not len(queue) or queue.fair.within_share(request):
            states = self.available(request)
            if states:
                return states
        deadline, again = queue.deadline(), False
        while True:  # woken when a slot frees; another request may have taken it
            await queue.wait_turn(deadline, request, again)
            states = self.available(request)
            if states:
                return states
            again = True

    def serving(self, request: RoutingRequest) -> list[ReplicaState]:
        """Healthy replicas that serve the request's model (and adapter)."""
        states = self.pool.states
        if request.adapter is None and len(self.models.policies) <= 1:
            return states  # one model: every replica serves it
        served = ServedName(request.model or self.models.default_model, request.adapter)
        return self.models.serving(served, states)

    def available(self, request: RoutingRequest) -> list[ReplicaState]:
        """Those of :meth:`serving` with a slot free for the request: below their cap
        of requests in flight, less the reserve for a tenant beyond its share, over
        it on its home for one within (router/fair/slots.py)."""
        config = self.config
        return with_free_slot(
            request,
            self.serving(request),
            self.queue.fair,
            config.max_outstanding_per_replica,
            config.fair_reserve_per_replica,
            lambda: self.models.policy(request.model).holders(request),
            config.max_engine_waiting,
        )

    def after_failure(self, request: RoutingRequest) -> list[ReplicaState]:
        """Where a retry may go once a try failed (circuits may have opened)."""
        return self.available(request) or self.serving(request)
