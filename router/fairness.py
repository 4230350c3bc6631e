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

Each charge is divided by the tenant's weight. As in VTC, a tenant that starts waiting
after being idle is lifted to the least service among those waiting, so idle time
banks no credit it could later spend to starve others.

Request classes order the queue before fairness does: every waiting ``interactive``
request goes before any ``batch`` one.

The charging is a choice (``--fairness``), so that the three can be compared on one
workload: ``prefill`` (the above), ``vtc`` (every prompt and generated token, as VTC
charges) and ``fcfs`` (no tenants: first come, first served within a class).
"""

from __future__ import annotations

from collections import defaultdict, deque
from collections.abc import Iterable
from typing import TYPE_CHECKING, Generic, TypeVar

if TYPE_CHECKING:
    from router.policies import RoutingRequest

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
    """Each tenant's service so far, in weighted tokens (``None``: tenant-less), charged
    as ``mode`` says (one of :data:`FAIRNESS`)."""

    def __init__(self, mode: str = "prefill") -> None:
        check_fairness(mode)
        self.mode = mode
        self.service: defaultdict[str | None, float] = defaultdict(float)
        #: Tokens charged, unweighted: what each tenant cost the fleet.
        self.charged_tokens: defaultdict[str | None, int] = defaultdict(int)

    def queue_key(self, tenant: str | None) -> str | None:
        """The queue a tenant's requests wait in (``fcfs``: one for all)."""
        return None if self.mode == "fcfs" else tenant

    def dispatched(self, request: RoutingRequest) -> None:
        """``request`` was sent to a replica: charge what it is predicted to cost."""
        self.charge(request.tenant, self._at_dispatch(request), request.weight)

    def ended(
        self, request: RoutingRequest, cached: int | None, generated: int, failed: bool = False
    ) -> None:
        """``request`` ended: correct its charge by what it really cost (a failed try:
        nothing; ``cached``: as the engine reported, ``None``: the prediction stands)."""
        cost = 0 if failed else self._in_all(request, cached, generated)
        self.charge(request.tenant, cost - self._at_dispatch(request), request.weight)

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
        self.service[tenant] += tokens / weight
        self.charged_tokens[tenant] += tokens

    def lift(self, tenant: str | None, waiting: Iterable[str | None]) -> None:
        """``tenant`` starts waiting: no less service than the least of those waiting."""
        floor = min((self.service[t] for t in waiting if t != tenant), default=None)
        if floor is not None and self.service[tenant] < floor:
            self.service[tenant] = floor


def check_fairness(mode: str) -> None:
    if mode not in FAIRNESS:
        raise ValueError(f"unknown fairness {mode!r}; known: {', '.join(FAIRNESS)}")


class FairQueue(Generic[T]):
    """Items waiting, a FIFO per request class's rank and tenant: :meth:`pop` takes the
    oldest of the most urgent class's least-served tenant (ties: the older queue)."""

    def __init__(self, fair: FairShare) -> None:
        self.fair = fair
        self._queues: dict[tuple[int, str | None], deque[T]] = {}
        self._count = 0  # asked on every request: kept, not summed

    def __len__(self) -> int:
        return self._count

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

    def pop(self) -> T | None:
        if not self._queues:
            return None
        key = min(self._queues, key=lambda k: (k[0], self.fair.service[k[1]]))
        queue = self._queues[key]
        item = queue.popleft()
        self._count -= 1
        if not queue:
            del self._queues[key]
        return item

    def remove(self, item: T, tenant: str | None, rank: int = 0) -> None:
        key = (rank, self.fair.queue_key(tenant))
        queue = self._queues.get(key)
        if queue is not None and item in queue:
            queue.remove(item)
            self._count -= 1
            if not queue:
                del self._queues[key]
