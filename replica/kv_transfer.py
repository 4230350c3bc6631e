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

from dataclasses import dataclass

from replica.prefix_cache import Block, PrefixCache


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
