"""Which replicas have a slot for a request: the cap, the reserve, the engine's own
queue, and a light tenant's home.

A gateway gives each replica at most ``max_outstanding`` requests at a time; the rest
wait in its queue (router/fair/admission.py), and the replayer's routers do the same.
With tenants, who may take a slot depends on their share (router/fair/fairness.py):

- A tenant **beyond its share** fills a replica only up to the cap less the
  ``reserve``: the reserved slots stay free for lighter tenants, so that their
  requests do not wait for a flood's to end. And it stays on its homes, the replicas
  predicted to hold the most of its prompt, while one of them has a slot: it spreads
  to another replica only when they are all full. Spreading computes its prefix
  there, and that prefill stalls every request in the replica's batch for as long
  (at 0.05x speed, 1,200 tokens held the steady tenants' requests 0.8 s); where a
  flood spread freely, it also left the lighter tenants' new prompts a single free
  replica, each computed after the other's. In replay, beside a tenant sending ten
  times their rate, the steady tenants' TTFT p99 went from 1.3-1.8x their figure
  alone to 0.9-1.1x (docs/results.md).
- A tenant **beyond its share** also adds nothing to an engine's own queue past
  ``max_engine_waiting`` requests: an engine that runs ``max_num_seqs`` at once (its
  card says) or that says it keeps requests waiting (its KV cache full) has no slot
  for it, whatever the cap. The engine's queue is first come, first served, where a
  light tenant's next request would wait behind the flood's; held at the gateway
  instead, the backlog is ordered by the fair queue, and the light tenant goes first
  (docs/results.md, "engines that queue"). A tenant within its share may still queue
  there, on its prompt's replica: it waits behind at most that many of the flood's.
  Homes whose engines have no room do not make the flood spread (only homes full at
  the cap do): it waits for them, rather than compute its prefix on a lighter
  tenant's replica (spreading there made 6 of 8 replayed seeds worse).
- A tenant **within its share** fills any replica up to the cap, and the replicas
  predicted to hold the most of its prompt up to twice the cap. Without that
  overflow, a light tenant's next turn finds its replica full (the flood holds all
  but the reserve, and the light tenants whose prompts live there share the reserve)
  and moves to a cold replica, where it prefills its whole history again: in replay,
  beside a tenant sending ten times its rate, that caused nine of a steady tenant's
  ten slowest first tokens. One more request on its home costs that replica a
  sequence in its batch; moving costs the whole prefix. Light tenants' conversations
  gather on a few replicas (those holding their prompts), so an overflow as small as
  the reserve still moved some of them (their TTFT p99 1.07-1.30x their figure alone
  over six seeds, against 0.94-1.09x at twice the cap; docs/results.md). This is the
  bound on affinity: it never holds a request in the queue, and a replica holds at
  most twice the cap, the part over the cap all within-share tenants' requests on
  their own prompts' replicas.

Without tenants, or first come first served, every request fills every replica up to
the cap.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from router.core import ReplicaState, RoutingRequest
from router.fair.fairness import FairShare


def with_free_slot(
    request: RoutingRequest,
    replicas: Sequence[ReplicaState],
    fair: FairShare,
    max_outstanding: int,
    reserve: int,
    holders: Callable[[], Mapping[str, int]],
    max_engine_waiting: int = 0,
) -> list[ReplicaState]:
    """Those of ``replicas`` that may take ``request`` now (see the module's doc);
    ``holders`` gives the prompt tokens each replica is predicted to hold, asked for a
    tenant beyond its share, and for one within it whose request might go over the cap.
    ``max_engine_waiting``: 0, engines' queues are not asked."""
    if not fair.within_share(request):
        cap = max_outstanding - min(reserve, max_outstanding - 1)
        free = [r for r in replicas if r.outstanding_requests < cap]
        go_to = _homes(free, holders()) or free
        return [r for r in go_to if engine_has_room(r, max_engine_waiting, reserve)]
    free = [r for r in replicas if r.outstanding_requests < max_outstanding]
    if fair.queue_key(request.tenant) is None:
        return free  # no tenants to keep apart
    full = [r for r in replicas if r.outstanding_requests >= max_outstanding]
    held = holders() if full else {}
    if not held:
        return free
    most = max(held.values())
    home = [
        r
        for r in full
        if held.get(r.replica_id) == most and r.outstanding_requests < 2 * max_outstanding
    ]
    return free + home


def engine_has_room(replica: ReplicaState, max_waiting: int, reserve: int) -> bool:
    """Whether the replica's engine has room for one more request of a tenant beyond
    its share (``max_waiting`` 0: not asked): it would still run fewer than its
    ``max_num_seqs`` less the ``reserve``, and fewer than ``max_waiting`` requests
    would wait in its queue, those it says are waiting (for KV blocks or a step's
    token budget) and those sent since it said so. A report's own handful of requests
    that arrived within its last step is below the bound.
    """
    if not max_waiting:
        return True
    limit = replica.max_num_seqs
    if limit is not None and replica.load_requests >= limit - min(reserve, limit - 1):
        return False
    waiting = replica.engine_waiting
    return not waiting or waiting + replica.requests_since_report < max_waiting


def _homes(replicas: Sequence[ReplicaState], held: Mapping[str, int]) -> list[ReplicaState]:
    """Those of ``replicas`` predicted to hold the most of the prompt (none: none holds
    any of it)."""
    most = max(held.values(), default=0)
    if not most:
        return []
    return [r for r in replicas if held.get(r.replica_id) == most]
