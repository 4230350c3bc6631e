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
from typing import Generic, TypeVar

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
    """Each tenant's service so far, in weighted tokens (``None``: tenant-less)."""

    def __init__(self) -> None:
        self.service: defaultdict[str | None, float] = defaultdict(float)
        #: Tokens charged, unweighted: what each tenant cost the fleet.
        self.charged_tokens: defaultdict[str | None, int] = defaultdict(int)

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


def dispatch_cost(mode: str, prompt_tokens: int, predicted_uncached_tokens: int) -> int:
    """What a request is charged when it is dispatched."""
    if mode == "prefill":
        return predicted_uncached_tokens
    return prompt_tokens if mode == "vtc" else 0


def final_cost(
    mode: str,
    prompt_tokens: int,
    predicted_uncached_tokens: int,
    cached_tokens: int | None,
    generated: int,
) -> int:
    """What a request cost in all, once it ended (``cached_tokens``: as the engine
    reported; ``None``: it did not say, and the prediction stands)."""
    if mode == "fcfs":
        return 0
    if mode == "vtc":
        return prompt_tokens + generated
    if cached_tokens is None:
        return predicted_uncached_tokens + generated
    return prompt_tokens - cached_tokens + generated


class FairQueue(Generic[T]):
    """Items waiting, a FIFO per request class's rank and tenant: :meth:`pop` takes the
    oldest of the most urgent class's least-served tenant (ties: the older queue)."""

    def __init__(self, fair: FairShare) -> None:
        self.fair = fair
        self._queues: dict[tuple[int, str | None], deque[T]] = {}

    def __len__(self) -> int:
        return sum(len(queue) for queue in self._queues.values())

    def waiting(self) -> dict[tuple[int, str | None], int]:
        return {key: len(queue) for key, queue in self._queues.items()}

    def push(self, item: T, tenant: str | None, rank: int = 0, front: bool = False) -> None:
        """Queue ``item`` last in its tenant's queue (``front``: first, as it was before
        a :meth:`pop` that could not be served)."""
        waiting = {t for _, t in self._queues}
        if tenant not in waiting and not front:
            self.fair.lift(tenant, waiting)  # back from idle: no banked credit
        queue = self._queues.setdefault((rank, tenant), deque())
        queue.appendleft(item) if front else queue.append(item)

    def pop(self) -> T | None:
        if not self._queues:
            return None
        key = min(self._queues, key=lambda k: (k[0], self.fair.service[k[1]]))
        queue = self._queues[key]
        item = queue.popleft()
        if not queue:
            del self._queues[key]
        return item

    def remove(self, item: T, tenant: str | None, rank: int = 0) -> None:
        queue = self._queues.get((rank, tenant))
        if queue is not None and item in queue:
            queue.remove(item)
            if not queue:
                del self._queues[(rank, tenant)]
