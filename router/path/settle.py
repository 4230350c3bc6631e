"""Stage 6 of the request path: settle a request's accounts, once at its first token
and once at its end, however it ends.

At the first token its prefill leaves the replica's queue; at the end (the last byte,
an error, the client gone) its load is released exactly once, its counters and its
tenant's service are corrected by what the replica reported (``cached_tokens``,
``completion_tokens``), and the slot it held goes to the next request waiting.
"""

from __future__ import annotations

from router.core import RoutingRequest
from router.fair.admission import AdmissionQueue
from router.path.accounting import Accounting
from router.path.place import Placement


class Settlement:
    """Settles one gateway's requests in its ``accounting`` and its fair ``queue``."""

    def __init__(self, accounting: Accounting, queue: AdmissionQueue) -> None:
        self.accounting, self.queue = accounting, queue

    def first_token(self, request: RoutingRequest, placement: Placement) -> None:
        self.accounting.first_token(request, placement.backend.state, placement.policy)

    def ended(
        self,
        request: RoutingRequest,
        placement: Placement,
        cached: int | None,
        failed: bool,
        generated: int = 0,
    ) -> None:
        """``cached``: the prompt tokens the replica reported cached (``None``: it did
        not say); ``generated``: the tokens it generated."""
        self.accounting.ended(request, placement.backend.state, placement.policy, cached, failed)
        self.queue.fair.ended(request, cached, generated, failed)
        self.queue.slot_freed()
