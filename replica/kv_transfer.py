"""KV that moves between engines: blocks a sender lends, and the pulls that read them.

Two uses share one mechanism, as in vLLM's NIXL connector:

- Prefill/decode disaggregation. A request sent with ``do_remote_decode`` runs on a
  prefill replica until its first token, and its prompt's blocks stay pinned there
  (held, ``hold_s``) until a decode replica pulls them or the hold times out.
- Peer pulls. A replica told that a peer holds a prompt's prefix asks the peer to lend
  those blocks (pinned for the pull's duration) and pulls them instead of computing them.

A pull runs beside the receiver's steps, as NIXL's reads do: the request waits, out of
the batch, until its bytes have crossed the receiver's link (one pull at a time per
link), then joins the queue with those blocks counted as computed; its decodes and
everyone else's go on meanwhile. The engine only pins and times: which peer to ask and
what it answered is the driver's (the replica server over HTTP, the replayer in
virtual time).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from replica.prefix_cache import Block, PrefixCache
from replica.sequence import Sequence


@dataclass(slots=True)
class Lease:
    """Blocks pinned for a peer to read, until ``until_s`` (engine time)."""

    blocks: list[Block]
    until_s: float
    #: Whether a peer has asked for them (a hold that times out unasked is counted).
    asked: bool = False


@dataclass
class TransferStats:
    """What an engine's transfers did, both ways."""

    #: Holds that ended unasked (their decode never came).
    hold_timeouts: int = 0
    #: Blocks lent to peers (each lease's, when first asked for).
    lent_blocks: int = 0
    #: Pulls run, the prompt tokens they brought and the seconds their links were busy.
    pulls: int = 0
    pulled_tokens: int = 0
    pull_s: float = 0.0


class Leases:
    """The blocks an engine keeps pinned for peers, by lease id (a request's id)."""

    def __init__(self, cache: PrefixCache, stats: TransferStats) -> None:
        self._cache, self._stats = cache, stats
        self._leases: dict[str, Lease] = {}

    def __len__(self) -> int:
        return len(self._leases)

    def hold(self, lease_id: str, blocks: list[Block], until_s: float) -> None:
        """Pin ``blocks`` (a finished prefill's prompt) until ``until_s`` or a pull."""
        self._cache.acquire(blocks)
        self._leases[lease_id] = Lease(list(blocks), until_s)

    def lend(self, lease_id: str, block_hashes: list[int], until_s: float) -> int:
        """Blocks a peer may read, pinned until ``until_s``: those held under
        ``lease_id``, else the leading ``block_hashes`` this cache holds (a new lease).
        Returns how many (0: none, nothing pinned)."""
        lease = self._leases.get(lease_id)
        if lease is None:
            blocks = self._leading(block_hashes)
            if not blocks:
                return 0
            self._cache.acquire(blocks)
            self._leases[lease_id] = lease = Lease(blocks, until_s)
        if not lease.asked:
            lease.asked = True
            self._stats.lent_blocks += len(lease.blocks)
        lease.until_s = until_s
        return len(lease.blocks)

    def expire(self, now: float) -> None:
        """Unpin the leases whose time is up (those never asked for timed out)."""
        ended = [lease_id for lease_id, lease in self._leases.items() if lease.until_s <= now]
        for lease_id in ended:
            lease = self._leases.pop(lease_id)
            self._stats.hold_timeouts += not lease.asked
            self._cache.release(reversed(lease.blocks))

    def release_all(self) -> None:
        self.expire(float("inf"))

    def _leading(self, block_hashes: list[int]) -> list[Block]:
        blocks = []
        for block_hash in block_hashes:
            block = self._cache.lookup(block_hash)
            if block is None:
                break
            blocks.append(block)
        return blocks


class Pulls:
    """The requests waiting for KV to cross into an engine, by when each wait ends: one
    pull at a time over the engine's link (``pull_s``: a pull's seconds for its
    tokens), and the requests that wait for a pull under way that brings their prefix
    (a second request of a prompt being pulled computes nothing the pull brings)."""

    def __init__(self, pull_s: Callable[[int], float], stats: TransferStats) -> None:
        self._pull_s, self._stats = pull_s, stats
        self._heap: list[tuple[float, int, Sequence]] = []
        self._ends: dict[str, float] = {}
        #: The leading blocks of its prompt each waiting request will find when its
        #: wait ends (its own pull's, or those of the pull it waits for).
        self._brings: dict[str, int] = {}
        #: The pulls under way, by request id: what another request may wait for.
        self._pulling: dict[str, Sequence] = {}
        self._link_free_s = 0.0
        self._count = 0

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Sequence]:
        return (seq for _, _, seq in self._heap)

    def start(self, seq: Sequence, tokens: int, now: float) -> None:
        """Pull ``tokens`` for ``seq`` from ``now``, after the pulls ahead on the link."""
        seconds = self._pull_s(tokens)
        ends = self.would_end_s(tokens, now)
        self._link_free_s = ends
        self._queue(seq, seq.pulled_blocks, ends)
        self._pulling[seq.request_id] = seq
        self._stats.pulls += 1
        self._stats.pulled_tokens += tokens
        self._stats.pull_s += seconds

    def wait_for(self, seq: Sequence, blocks: int, ends: float) -> None:
        """Queue ``seq`` when a pull under way ends that brings its ``blocks`` leading
        blocks: it finds them cached then, as the pulling request's (nothing crosses
        the link twice; a pull aborted meanwhile brings nothing, and it computes them)."""
        self._queue(seq, blocks, ends)

    def arriving(self, block_hashes: list[int]) -> tuple[int, float]:
        """The most leading blocks of ``block_hashes`` a pull under way brings, and when
        that pull ends ((0, 0.0): none)."""
        best, ends = 0, 0.0
        for seq in self._pulling.values():
            shared = _leading_run(seq.block_hashes[: seq.pulled_blocks], block_hashes)
            if shared > best:
                best, ends = shared, self._ends[seq.request_id]
        return best, ends

    def brings(self, seq: Sequence) -> int:
        """The leading blocks ``seq`` will find when its wait ends."""
        return self._brings.get(seq.request_id, 0)

    def _queue(self, seq: Sequence, blocks: int, ends: float) -> None:
        self._count += 1
        heapq.heappush(self._heap, (ends, self._count, seq))
        self._ends[seq.request_id] = ends
        self._brings[seq.request_id] = blocks

    def would_end_s(self, tokens: int, now: float) -> float:
        """When a pull of ``tokens`` started at ``now`` would end."""
        return max(now, self._link_free_s) + self._pull_s(tokens)

    def end_of(self, request_id: str) -> float | None:
        return self._ends.get(request_id)

    @property
    def next_end_s(self) -> float | None:
        return self._heap[0][0] if self._heap else None

    def ended(self, now: float) -> Iterator[Sequence]:
        """The requests whose pulls have ended by ``now``, in the order they ended."""
        while self._heap and self._heap[0][0] <= now:
            _, _, seq = heapq.heappop(self._heap)
            self._forget(seq.request_id)
            yield seq

    def drop(self, seq: Sequence) -> bool:
        """Forget ``seq``'s pull (aborted); ``False`` if it has none under way."""
        if seq.request_id not in self._ends:
            return False
        self._forget(seq.request_id)
        self._heap = [entry for entry in self._heap if entry[2] is not seq]
        heapq.heapify(self._heap)
        return True

    def _forget(self, request_id: str) -> None:
        del self._ends[request_id], self._brings[request_id]
        self._pulling.pop(request_id, None)


def _leading_run(a: list[int], b: list[int]) -> int:
    """How many leading block hashes ``a`` and ``b`` share (a block's hash chains its
    prefix's, so the first difference ends the shared prefix)."""
    shared = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        shared += 1
    return shared
