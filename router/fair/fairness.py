"""Fair shares of a saturated fleet, charged in the prefill a request really costs.

When every replica is at its admission limit, requests wait at the gateway; which one
goes next decides who gets the fleet. First come, first served lets one tenant that
floods the gateway delay every other tenant's first token. The Virtual Token Counter
(VTC: Sheng et al., OSDI 2024; AIBrix ships it) serves instead the waiting tenant that
has received the least service, but charges every prompt token, cached or not. A
prefix-cached fleet does not spend the same on both: a cached token costs no prefill.
So a tenant here is charged what its request actually costs the fleet (the
cache-aware idea of DLPM, arXiv 2501.14312):

- at dispatch, the prompt tokens the router predicts the chosen replica does *not*
  hold (``RoutingRequest.predicted_uncached_tokens``);
- at the end, corrected by what the engine reported it had cached, plus the tokens
  it generated.

Each charge is divided by the tenant's weight. Service is what a tenant received
lately, not since the gateway started: it decays with a half-life (``half_life_s``,
30 s by default). A tenant that sends less than its share then keeps less service
than one that floods and goes first whenever it waits, so its first token does not
wait on the flood; and idle time banks at most the service others receive within a
few half-lives, so a tenant back from idle cannot starve others for long. VTC instead
keeps counters for ever and lifts a tenant that starts waiting after being idle to
the least service among those waiting (``half_life_s=0`` does that): it bounds how
far service drifts apart, but puts a returning light tenant level with the flood, so
it waits its turn in a rotation with it.

Request classes order the queue before fairness does: every waiting ``interactive``
request goes before any ``batch`` one.

The charging is a choice (``--fairness``), so that the three can be compared on one
workload: ``prefill`` (the above), ``vtc`` (every prompt and generated token, as VTC
charges) and ``fcfs`` (no tenants: first come, first served within a class).
"""

from __future__ import annotations

import math
import time
from collections import defaultdict, deque
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Generic, TypeVar

if TYPE_CHECKING:
    from router.core import RoutingRequest

T = TypeVar("T")

#: Request classes, most urgent first (a request's rank is its index), and the header
#: that names one.
PRIORITIES = ("interactive", "batch")
PRIORITY_HEADER = "x-priority"
#: How tenants are charged (see the module's doc).
FAIRNESS = ("prefill", "vtc", "fcfs")


def priority_rank(name: str) -> int:
    """The rank of a request class; :class:`ValueError` for an unknown one."""
    try:
        return PRIORITIES.index(name)
    except ValueError:
        raise ValueError(
            f"unknown request class {name!r}; known: {', '.join(PRIORITIES)}"
        ) from None


class FairShare:
    """Each tenant's recent service, in weighted tokens (``None``: tenant-less), charged
    as ``mode`` says (one of :data:`FAIRNESS`) and halved every ``half_life_s`` of
    ``clock`` (0: kept for ever, with VTC's lift)."""

    def __init__(
        self,
        mode: str = "prefill",
        half_life_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        check_fairness(mode)
        if half_life_s < 0:
            raise ValueError(f"the half-life must not be negative, got {half_life_s:g}")
        self.mode = mode
        self.half_life_s = half_life_s
        self.clock = clock
        self._service: dict[str | None, tuple[float, float]] = {}  # value, when
        self.in_flight: defaultdict[str | None, int] = defaultdict(int)
        self._weights: dict[str | None, float] = {}
        self._last_dispatch: dict[str | None, float] = {}
        #: Tokens charged, unweighted: what each tenant cost the fleet.
        self.charged_tokens: defaultdict[str | None, int] = defaultdict(int)

    def queue_key(self, tenant: str | None) -> str | None:
        """The queue a tenant's requests wait in (``fcfs``: one for all)."""
        return None if self.mode == "fcfs" else tenant

    def dispatched(self, request: RoutingRequest) -> None:
        """``request`` was sent to a replica: charge what it is predicted to cost."""
        tenant = request.tenant
        self.charge(tenant, self._at_dispatch(request), request.weight)
        self.in_flight[tenant] += 1
        self._weights[tenant] = request.weight
        self._last_dispatch[tenant] = self.clock()

    def ended(
        self, request: RoutingRequest, cached: int | None, generated: int, failed: bool = False
    ) -> None:
        """``request`` ended: correct its charge by what it really cost (a failed try:
        nothing; ``cached``: as the engine reported, ``None``: the prediction stands)."""
        cost = 0 if failed else self._in_all(request, cached, generated)
        self.charge(request.tenant, cost - self._at_dispatch(request), request.weight)
        self.in_flight[request.tenant] -= 1

    def within_share(self, request: RoutingRequest) -> bool:
        """Whether ``request``'s tenant has received no more than its share of the
        service of the tenants active now (in flight, or sent within a half-life):
        its service per unit of weight is at most theirs. Such a tenant may take the
        slots kept in reserve, so that a light tenant finds one free while a flood
        holds the rest."""
        tenant = request.tenant
        if self.mode == "fcfs" or tenant is None:
            return True
        now, recent = self.clock(), self.half_life_s
        weights = {
            t: w
            for t, w in self._weights.items()
            if self.in_flight[t] > 0 or now - self._last_dispatch[t] < recent
        }
        weights[tenant] = request.weight
        if len(weights) == 1:
            return True  # alone: the whole fleet is its share
        service = sum(w * self.standing(t) for t, w in weights.items())  # standing is per weight
        return self.standing(tenant) <= service / sum(weights.values())

    def _at_dispatch(self, request: RoutingRequest) -> int:
        if self.mode == "prefill":
            return request.predicted_uncached_tokens
        return request.num_prompt_tokens if self.mode == "vtc" else 0

    def _in_all(self, request: RoutingRequest, cached: int | None, generated: int) -> int:
        if self.mode == "fcfs":
            return 0
        if self.mode == "vtc":
            return request.num_prompt_tokens + generated
        if cached is None:
            return request.predicted_uncached_tokens + generated
        return request.num_prompt_tokens - cached + generated

    def charge(self, tenant: str | None, tokens: int, weight: float = 1.0) -> None:
        """Charge ``tokens`` (negative: a refund, when the engine cached more than
        predicted) to ``tenant``."""
        self._set(tenant, self.standing(tenant) + tokens / weight)
        self.charged_tokens[tenant] += tokens

    def standing(self, tenant: str | None) -> float:
        """``tenant``'s service now: the least goes next."""
        value, when = self._service.get(tenant, (0.0, 0.0))
        if not self.half_life_s or not value:
            return value
        return value * math.exp2((when - self.clock()) / self.half_life_s)

    def _set(self, tenant: str | None, value: float) -> None:
        self._service[tenant] = (value, self.clock())

    def lift(self, tenant: str | None, waiting: Iterable[str | None]) -> None:
        """``tenant`` starts waiting: without decay, no less service than the least of
        those waiting (VTC's rule; decay bounds banked credit by itself)."""
        if self.half_life_s:
            return
        floor = min((self.standing(t) for t in waiting if t != tenant), default=None)
        if floor is not None and self.standing(tenant) < floor:
            self._set(tenant, floor)


def check_fairness(mode: str) -> None:
    if mode not in FAIRNESS:
        raise ValueError(f"unknown fairness {mode!r}; known: {', '.join(FAIRNESS)}")


class FairQueue(Generic[T]):
    """Items waiting, a FIFO per request class's rank and tenant: :meth:`pop` takes the
    oldest of the most urgent class's least-served tenant (ties: the older queue), or
    the first in that order that can be served."""

    def __init__(self, fair: FairShare) -> None:
        self.fair = fair
        self._queues: dict[tuple[int, str | None], deque[T]] = {}
        self._count = 0  # asked on every request: kept, not summed

    def __len__(self) -> int:
        return self._count

    def __iter__(self) -> Iterator[T]:
        """Every item waiting (in no particular order)."""
        for queue in self._queues.values():
            yield from queue

    def waiting(self) -> dict[tuple[int, str | None], int]:
        return {key: len(queue) for key, queue in self._queues.items()}

    def push(self, item: T, tenant: str | None, rank: int = 0, front: bool = False) -> None:
        """Queue ``item`` last in its tenant's queue (``front``: first, as it was before
        a :meth:`pop` that could not be served)."""
        tenant = self.fair.queue_key(tenant)
        waiting = {t for _, t in self._queues}
        if tenant not in waiting and not front:
            self.fair.lift(tenant, waiting)  # back from idle: no banked credit
        queue = self._queues.setdefault((rank, tenant), deque())
        queue.appendleft(item) if front else queue.append(item)
        self._count += 1

    def pop(self, can_serve: Callable[[T], bool] | None = None) -> T | None:
        """The next item, or with ``can_serve`` the next that it accepts (a tenant
        beyond its share cannot take the reserve another tenant can): only the head
        of each queue is asked, so each tenant's requests stay in order."""
        order = lambda key: (key[0], self.fair.standing(key[1]))  # noqa: E731
        if can_serve is None:
            keys = [min(self._queues, key=order)] if self._queues else []
        else:
            keys = sorted(self._queues, key=order)
        for key in keys:
            queue = self._queues[key]
            if can_serve is None or can_serve(queue[0]):
                item = queue.popleft()
                self._count -= 1
                if not queue:
                    del self._queues[key]
                return item
        return None

    def remove(self, item: T, tenant: str | None, rank: int = 0) -> None:
        key = (rank, self.fair.queue_key(tenant))
        queue = self._queues.get(key)
        if queue is not None and item in queue:
            queue.remove(item)
            self._count -= 1
            if not queue:
                del self._queues[key]
