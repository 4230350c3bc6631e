"""Admission control: bounded work per replica, a bounded queue in front of them.

A replica takes at most ``max_outstanding`` requests from the gateway at a time.
When every replica is full, a request waits in the gateway's queue for a slot, at
most ``max_queued`` of them and each at most ``timeout_s``; beyond either bound it is
refused at once (429 with ``Retry-After``), so neither the queue nor the memory it
holds can grow without limit, and the latency of admitted requests stays bounded.
A freed slot goes to the most urgent request class waiting, then to the tenant that
has received the least service (router/fairness.py), then first come, first served:
without tenants or classes, a FIFO.
"""

from __future__ import annotations

import asyncio

from router.fairness import FairQueue, FairShare


class Overloaded(Exception):
    """The request cannot be admitted now; the client should retry after a while."""

    def __init__(self, message: str, retry_after_s: int = 1) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class AdmissionQueue:
    """Requests waiting for a replica slot: a FIFO per request class and tenant."""

    def __init__(self, max_queued: int, timeout_s: float, fair: FairShare | None = None) -> None:
        self.max_queued = max_queued
        self.timeout_s = timeout_s
        self.fair = fair or FairShare()
        self._waiters: FairQueue[asyncio.Future[None]] = FairQueue(self.fair)
        self.refused = 0  # requests turned away, queue full or waited too long

    def __len__(self) -> int:
        return len(self._waiters)

    def deadline(self) -> float:
        return asyncio.get_running_loop().time() + self.timeout_s

    async def wait_turn(self, deadline: float, tenant: str | None = None, rank: int = 0) -> None:
        """Wait until :meth:`slot_freed` wakes this request; raise :class:`Overloaded`
        if the queue is full or ``deadline`` (event-loop time) passes first."""
        if len(self) >= self.max_queued:
            self.refused += 1
            raise Overloaded(f"all replicas are busy and {self.max_queued} requests are queued")
        loop = asyncio.get_running_loop()
        waiter: asyncio.Future[None] = loop.create_future()
        self._waiters.push(waiter, tenant, rank)
        try:
            await asyncio.wait_for(waiter, max(deadline - loop.time(), 0.0))
        except TimeoutError:
            self.refused += 1
            raise Overloaded(f"no replica was free within {self.timeout_s:g} s") from None
        except asyncio.CancelledError:  # the client left
            if waiter.done() and not waiter.cancelled():
                self.slot_freed()  # it had just been woken: pass the turn on
            raise
        finally:
            if not waiter.done() or waiter.cancelled():
                self._waiters.remove(waiter, tenant, rank)

    def slot_freed(self) -> None:
        """A replica finished a request: wake the next one (see the module's doc)."""
        while (waiter := self._waiters.pop()) is not None:
            if not waiter.done():
                waiter.set_result(None)
                return
