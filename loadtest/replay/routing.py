"""A request's way through one router, as through a gateway.

The policy of the model it names chooses among the replicas that serve it (within its
tenant's cache budget, and, with ``max_outstanding``, among those with a slot free for
it: router/fair/slots.py); load is counted at dispatch and released at the end.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from loadtest.replay.config import ReplayConfig
from loadtest.replay.request import TurnRequest
from replica.engine import RequestOutput
from router.core import ReplicaState
from router.fair.cache_budget import within_budget
from router.fair.fairness import FairQueue, FairShare
from router.fair.slots import with_free_slot
from router.fleet import load
from router.fleet.models import ModelRoutes, ServedName
from router.policies import Policy


class Router:
    """One router: its policies (one per model), its view of every replica (by the
    engine's index), and its fair share and queue of requests waiting for a slot."""

    def __init__(
        self,
        routes: ModelRoutes,
        states: list[ReplicaState],
        config: ReplayConfig,
        clock: Callable[[], float],
    ) -> None:
        self.routes, self.states = routes, states
        self.fair_share = FairShare(config.fairness, config.fair_half_life_s, clock=clock)
        self.queue: FairQueue[TurnRequest] = FairQueue(self.fair_share)
        self._config, self._clock = config, clock

    def policy(self, request: TurnRequest) -> Policy:
        return self.routes.policy(request.routing.model)

    def serving(self, request: TurnRequest, routable: list[int] | None) -> list[ReplicaState]:
        """The replicas that serve ``request``'s model: of a scaling fleet, those
        ``routable``; of a fleet of several models, those of its model (and adapter)."""
        if routable is not None:
            return [self.states[i] for i in routable]
        if not self._config.fleet:
            return self.states
        routing = request.routing
        served = ServedName(routing.model or self.routes.default_model, routing.adapter)
        return self.routes.serving(served, self.states)

    def wait(self, request: TurnRequest) -> None:
        """Queue ``request`` until a replica has a slot free for it."""
        self.queue.push(request, request.routing.tenant, request.routing.priority)

    def admitted(
        self, routable: list[int] | None
    ) -> Iterator[tuple[TurnRequest, list[ReplicaState]]]:
        """From the queue, the next in line while a replica that serves it has a slot
        free (as slots free at a gateway), with those replicas."""
        can_serve = lambda request: bool(self._free(request, routable))  # noqa: E731
        while (request := self.queue.pop(can_serve)) is not None:
            yield request, self._free(request, routable)

    def choose(self, request: TurnRequest, candidates: list[ReplicaState], salt: str | None) -> int:
        """The engine the policy sends ``request`` to, among ``candidates`` (those
        within its tenant's cache budget, if any is)."""
        policy = self.policy(request)
        allowed = within_budget(policy, request.routing, candidates, (salt,))
        request.routing.kv = None  # the policy plans it anew
        return self.states.index(policy.choose(request.routing, allowed))

    def dispatched(self, request: TurnRequest, index: int, leg: bool = False) -> None:
        """``request`` (or, ``leg``, its prefill leg) went to engine ``index``."""
        replica = self.states[index]
        load.dispatched(self.policy(request), request.routing, replica, now=self._clock())
        if not leg:
            self.fair_share.dispatched(request.routing)

    def prefilled(self, request: TurnRequest, index: int) -> None:
        load.prefilled(request.routing, self.states[index])

    def completed(
        self, request: TurnRequest, index: int, output: RequestOutput, leg: bool = False
    ) -> None:
        cached = output.num_cached_tokens
        load.completed(self.policy(request), request.routing, self.states[index], cached)
        if not leg:
            self.fair_share.ended(request.routing, cached, output.num_output_tokens)

    def _free(self, request: TurnRequest, routable: list[int] | None) -> list[ReplicaState]:
        """The replicas that serve ``request`` with a slot free for it."""
        config, policy = self._config, self.policy(request)
        return with_free_slot(
            request.routing,
            self.serving(request, routable),
            self.fair_share,
            config.max_outstanding,
            config.fair_reserve_per_replica,
            lambda: policy.holders(request.routing),
            config.max_engine_waiting,
        )
