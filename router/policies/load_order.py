"""The fleet ordered by load, so a decision need not price every replica.

A replica that holds none of a prompt costs the same recomputation as every other such
replica, plus its own load; only its load tells them apart. The load ``cache_aware``
weighs is ``queued prefill + a x requests + b x max(0, requests + 1 - cap)``: for one
number of requests ``h`` it grows with the queued prefill alone. So replicas are kept in
buckets by ``h``, each sorted by queued prefill: the cheapest replica outside a small
set is found by looking at the head of each bucket (there are as many buckets as
distinct request counts, a few dozen at most), whatever the fleet's size. Every change
of a replica's load re-files it (``router/fleet/load.py`` calls :meth:`LoadOrder.update`).
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Collection
from dataclasses import dataclass

from router.core import ReplicaState

#: A replica's load from its queued prefill tokens and its requests: non-decreasing in
#: the prefill (the one function the policy's full scan uses too, so both agree exactly).
Load = Callable[[int, int], float]


@dataclass
class Cheapest:
    """The least load found, and where the replicas that have it lie."""

    load: float
    tied: list[tuple[list[tuple[int, str]], int, int]]  # bucket, and a range of it

    def members(self, skip: Collection[str] = ()) -> list[str]:
        """The replicas at that load, but those in ``skip``."""
        return [
            replica_id
            for bucket, low, high in self.tied
            for _, replica_id in bucket[low:high]
            if replica_id not in skip
        ]


class LoadOrder:
    """Every replica of the fleet, bucketed by requests and sorted by queued prefill."""

    def __init__(self) -> None:
        self.states: dict[str, ReplicaState] = {}
        self.total_requests = 0
        #: Replicas in the order they joined: the order the router lists them in, so
        #: that ties break as they would in a scan of that list.
        self.rank: dict[str, int] = {}
        self._joined = 0
        self._filed: dict[str, tuple[int, int]] = {}  # replica -> (requests, prefill)
        self._buckets: dict[int, list[tuple[int, str]]] = {}  # requests -> sorted (prefill, id)

    def __len__(self) -> int:
        return len(self.states)

    def update(self, replica: ReplicaState) -> None:
        """File ``replica`` under its current load (adding it if it is new)."""
        replica_id = replica.replica_id
        self.states[replica_id] = replica
        if replica_id not in self.rank:
            self.rank[replica_id], self._joined = self._joined, self._joined + 1
        key = (replica.load_requests, replica.load_prefill_tokens)
        old = self._filed.get(replica_id)
        if old == key:
            return
        if old is not None:
            self._unfile(replica_id, old)
        self._filed[replica_id] = key
        self.total_requests += key[0]
        bisect.insort(self._buckets.setdefault(key[0], []), (key[1], replica_id))

    def remove(self, replica_id: str) -> None:
        old = self._filed.pop(replica_id, None)
        self.states.pop(replica_id, None)
        self.rank.pop(replica_id, None)
        if old is not None:
            self._unfile(replica_id, old)

    def _unfile(self, replica_id: str, key: tuple[int, int]) -> None:
        self.total_requests -= key[0]
        bucket = self._buckets[key[0]]
        del bucket[bisect.bisect_left(bucket, (key[1], replica_id))]
        if not bucket:
            del self._buckets[key[0]]

    def cheapest(self, load_of: Load, skip: Collection[str] = ()) -> Cheapest | None:
        """The least load among replicas not in ``skip``, and every replica at that
        load (some may be in ``skip``); ``None`` if every replica is skipped."""
        best: Cheapest | None = None
        for requests, bucket in self._buckets.items():
            head = _first_not_in(bucket, skip)
            if head is None:
                continue
            load = load_of(bucket[head][0], requests)
            if best is not None and load > best.load:
                continue
            end = bisect.bisect_right(bucket, load, lo=head, key=_by_load(load_of, requests))
            tie = (bucket, head, end)
            best = Cheapest(load, [tie]) if best is None or load < best.load else best
            if best.tied[-1] is not tie:
                best.tied.append(tie)
        return best

    def least_waiting(self) -> int:
        """The requests waiting on the least queued replica, as the replicas with the
        fewest requests say (a replica's waiting requests are its requests less those
        running: the fewest requests, the shortest queue, but for a replica whose batch
        holds fewer), without a scan of the fleet."""
        if not self._buckets:
            return 0
        fewest = self._buckets[min(self._buckets)]
        return min(self.states[replica_id].load_waiting for _, replica_id in fewest)

    def within(self, load_of: Load, ceiling: float) -> list[ReplicaState]:
        """Every replica whose load is at most ``ceiling``."""
        found = []
        for requests, bucket in self._buckets.items():
            end = bisect.bisect_right(bucket, ceiling, key=_by_load(load_of, requests))
            found += [self.states[replica_id] for _, replica_id in bucket[:end]]
        return found


def _by_load(load_of: Load, requests: int) -> Callable[[tuple[int, str]], float]:
    """A bucket entry's load, for ``bisect``."""
    return lambda entry: load_of(entry[0], requests)


def _first_not_in(bucket: list[tuple[int, str]], skip: Collection[str]) -> int | None:
    for position, (_, replica_id) in enumerate(bucket):
        if replica_id not in skip:
            return position
    return None
