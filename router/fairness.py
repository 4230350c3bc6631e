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
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable

#: Request classes, most urgent first (a request's rank is its index), and the header
#: that names one.
PRIORITIES = ("interactive", "batch")
PRIORITY_HEADER = "x-priority"


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
