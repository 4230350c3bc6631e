"""Admission control: bounded work per replica, a bounded queue in front of them.

A replica takes at most ``max_outstanding`` requests from the gateway at a time.
When every replica is full, a request waits in the gateway's queue for a slot, at
most ``max_queued`` of them and each at most ``timeout_s``; beyond either bound it is
refused at once (429 with ``Retry-After``), so neither the queue nor the memory it
holds can grow without limit, and the latency of admitted requests stays bounded.
A freed slot goes to the most urgent request class waiting, then to the tenant that
has received the least service (router/fair/fairness.py), then first come, first served:
without tenants or classes, a FIFO. A request that could not take the slot (it is
beyond its share, and the slot is held in reserve) is passed over for the next.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from router.fair.fairness import FairQueue, FairShare

if TYPE_CHECKING:
    from router.core import RoutingRequest


class Overloaded(Exception):
    """The request cannot be admitted now; the client should retry after a while."""

    def __init__(self, message: str, retry_after_s: int = 1) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


@dataclass(eq=False)  # each waiter is itself: removed by identity
class _Waiter:
    request: RoutingRequest
    woken: asyncio.Future[None] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )


class AdmissionQueue:
    """Requests waiting for a replica slot: a FIFO per request class and tenant.
    ``can_serve`` says whether a request could take a slot now (none: any can)."""

    def __init__(
        self,
        max_queued: int,
        timeout_s: float,
        fair: FairShare | None = None,
        can_serve: Callable[[RoutingRequest], bool] | None = None,
    ) -> None:
        self.max_queued = max_queued
        self.timeout_s = timeout_s
        self.fair = fair or FairShare()
        self.can_serve = can_serve
        self._waiters: FairQueue[_Waiter] = FairQueue(self.fair)
        self.refused = 0  # requests turned away, queue full or waited too long

    def __len__(self) -> int:
        return len(self._waiters)

    def deadline(self) -> float:
        return asyncio.get_running_loop().time() + self.timeout_s

    async def wait_turn(
        self, deadline: float, request: RoutingRequest, again: bool = False
    ) -> None:
        """Wait until :meth:`slot_freed` wakes this request; raise :class:`Overloaded`
        if the queue is full or ``deadline`` (event-loop time) passes first. ``again``:
        woken before but the slot was gone, it waits first in its queue."""
        if len(self) >= self.max_queued:
            self.refused += 1
            raise Overloaded(f"all replicas are busy and {self.max_queued} requests are queued")
        loop = asyncio.get_running_loop()
        waiter = _Waiter(request)
        self._waiters.push(waiter, request.tenant, request.priority, front=again)
        try:
            await asyncio.wait_for(waiter.woken, max(deadline - loop.time(), 0.0))
        except TimeoutError:
            self.refused += 1
            raise Overloaded(f"no replica was free within {self.timeout_s:g} s") from None
        except asyncio.CancelledError:  # the client left
            if waiter.woken.done() and not waiter.woken.cancelled():
                self.slot_freed()  # it had just been woken: pass the turn on
            raise
        finally:
            if not waiter.woken.done() or waiter.woken.cancelled():
                self._waiters.remove(waiter, request.tenant, request.priority)

    def slot_freed(self) -> None:
        """A replica finished a request: wake the next one that can take a slot (see
        the module's doc)."""
        can_serve = self.can_serve
        accept = None if can_serve is None else (lambda waiter: can_serve(waiter.request))
        while (waiter := self._waiters.pop(accept)) is not None:
            if not waiter.woken.done():
                waiter.woken.set_result(None)
                return
