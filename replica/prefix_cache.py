"""A block pool with a prefix cache: identity -> block, reference counts, leaf-only LRU.

Every physical block is in exactly one of three states:

- **free**: on the free list, holding nothing;
- **private**: pinned by a request (``ref_count > 0``) but not (yet) cached, such as
  a request's trailing partial block;
- **cached**: registered under its identity. A cached block with ``ref_count > 0``
  is pinned; with ``ref_count == 0`` it is *idle*: it still holds its KV and can be
  hit again, and it becomes *evictable* once no cached block hangs off it.

A request pins every block of its block table, so the pinned blocks are closed under
"parent of": every idle block can be reclaimed, leaves first, which is why idle
blocks count as available.

Eviction is LRU over evictable leaves only. A block with a cached child is never a
candidate (its children's identities were computed through it), nor is a pinned one,
so a shared system prompt with conversations hanging off it survives any churn.
Candidates sit in a heap keyed by a unique use stamp with lazy deletion, which costs
O(log n) per eviction and never scans the cache.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from replica.api.kv_events import KVEvent
from replica.api.tokenizer import TOKEN_DTYPE
from replica.event_log import EventLog


class NoFreeBlocksError(RuntimeError):
    """Raised by :meth:`PrefixCache.allocate` when free plus evictable blocks fall short."""


@dataclass(eq=False, slots=True)
class Block:
    """One physical KV block. ``token_bytes`` is kept while cached to verify every hit."""

    block_id: int
    ref_count: int = 0
    block_hash: int | None = None
    parent: Block | None = None
    num_children: int = 0
    token_bytes: bytes = b""
    last_used: int = 0
    depth: int = 0  # position in its prompt, in blocks (0 for the first block)
    salt: str | None = None  # the cache salt that seeded it, kept for a first block
    lora: str | None = None  # the LoRA adapter that seeded it, kept for a first block

    @property
    def is_cached(self) -> bool:
        return self.block_hash is not None

    @property
    def is_evictable(self) -> bool:
        return self.block_hash is not None and self.ref_count == 0 and self.num_children == 0


class EvictedBlock(NamedTuple):
    """What an evicted block held, handed to the host tier before it is forgotten."""

    block_hash: int
    parent_hash: int | None
    token_bytes: bytes
    depth: int
    salt: str | None = None  # the cache salt of a prompt's first block
    lora: str | None = None  # and its LoRA adapter


class _Run:
    """Blocks cached one after another, logged as one ``stored`` event."""

    __slots__ = ("hashes", "start", "tokens")

    def __init__(self, start: int) -> None:
        self.start = start
        self.hashes: list[int] = []
        self.tokens: list[bytes] = []

    def add(self, block_hash: int, tokens: bytes) -> None:
        self.hashes.append(block_hash)
        self.tokens.append(tokens)


class _FreeBlocks:
    """The empty blocks, first in first out. A block's object is made on its first use,
    so a cache costs memory for the blocks it used, not for its size: a replay of a
    thousand replicas of 26,000 blocks each would otherwise start with 26 M objects."""

    __slots__ = ("made", "recycled", "size")

    def __init__(self, size: int) -> None:
        self.size = size
        self.made: list[Block] = []  # every block made so far, by id
        self.recycled: deque[Block] = deque()  # made, then freed

    def __len__(self) -> int:
        return self.size - len(self.made) + len(self.recycled)

    def take(self) -> Block:
        """The next empty block: blocks never used first, in id order, then freed ones."""
        if len(self.made) < self.size:
            block = Block(len(self.made))
            self.made.append(block)
            return block
        return self.recycled.popleft()

    def append(self, block: Block) -> None:
        self.recycled.append(block)


@dataclass(slots=True)
class CacheStats:
    """Counters since the last reset. Queries count prompt tokens and full prompt blocks."""

    query_tokens: int = 0
    #: Prompt tokens not recomputed: found on the GPU or loaded from the host tier.
    hit_tokens: int = 0
    query_blocks: int = 0
    hit_blocks: int = 0
    stored_blocks: int = 0
    evictions: int = 0
    #: Of the hits, those loaded from the host tier.
    host_hit_tokens: int = 0
    host_hit_blocks: int = 0
    #: Of the hits, those pulled from a peer replica's cache.
    pulled_tokens: int = 0

    @property
    def token_hit_rate(self) -> float:
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0

    @property
    def block_hit_rate(self) -> float:
        return self.hit_blocks / self.query_blocks if self.query_blocks else 0.0


@dataclass
class PrefixCache:
    """``num_blocks`` blocks of ``block_size`` tokens, shared by all requests of an engine.

    Contract: callers pin what they use (:meth:`acquire` for hits, :meth:`allocate`
    for new blocks) and unpin it with :meth:`release`; only blocks a caller pins may
    be passed to :meth:`cache_block`, and a cached block's parent must be pinned by
    the same caller at that moment.
    """

    num_blocks: int
    block_size: int
    max_events: int = 100_000
    stats: CacheStats = field(default_factory=CacheStats)
    #: Called with the blocks each eviction took, before they are forgotten (the
    #: engine demotes them to its host tier); in eviction order, leaves first.
    on_evicted: Callable[[list[EvictedBlock]], object] | None = None

    def __post_init__(self) -> None:
        if self.num_blocks < 1 or self.block_size < 1:
            raise ValueError("num_blocks and block_size must be positive")
        self._free = _FreeBlocks(self.num_blocks)
        self._blocks = self._free.made
        self._cached: dict[int, Block] = {}
        self._candidates: list[tuple[int, Block]] = []  # (last_used, block), lazily pruned
        self._num_idle = 0
        self._clock = 0
        self.events = EventLog(self.max_events)

    # ----------------------------------------------------------------- queries

    def match(self, block_hashes: Sequence[int], token_bytes: bytes) -> list[Block]:
        """The longest run of leading cached blocks whose tokens equal the prompt's.

        ``token_bytes`` holds the prompt's tokens from its start. A hash whose stored
        tokens differ (a collision) ends the run like a miss. Nothing is pinned.
        """
        step = self.block_size * TOKEN_DTYPE.itemsize
        hits: list[Block] = []
        get = self._cached.get
        for i, block_hash in enumerate(block_hashes):
            block = get(block_hash)
            if block is None or block.token_bytes != token_bytes[i * step : (i + 1) * step]:
                break
            hits.append(block)
        return hits

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= len(self._free) + self._num_idle

    def lookup(self, block_hash: int) -> Block | None:
        return self._cached.get(block_hash)

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    @property
    def num_idle_blocks(self) -> int:
        """Cached blocks no request pins: reusable by a hit, reclaimable by eviction."""
        return self._num_idle

    @property
    def usage(self) -> float:
        """Fraction of blocks pinned by requests (cached idle blocks count as available)."""
        return 1.0 - (len(self._free) + self._num_idle) / self.num_blocks

    @property
    def last_event_seq(self) -> int:
        return self.events.last_seq

    def events_since(self, seq: int) -> tuple[list[KVEvent], bool]:
        """Events with a sequence number above ``seq``, and whether any were lost.

        Lost events (the log holds ``max_events``) mean the consumer must resync.
        """
        return self.events.since(seq)

    # ---------------------------------------------------------------- commands

    def acquire(self, blocks: Iterable[Block]) -> None:
        """Pin cached blocks (a hit): they can no longer be evicted."""
        for block in blocks:
            if block.ref_count == 0:
                self._num_idle -= 1
            block.ref_count += 1

    def allocate(self, num_blocks: int) -> list[Block]:
        """Pin ``num_blocks`` empty blocks, evicting LRU leaves if the free list runs dry."""
        if not self.can_allocate(num_blocks):
            raise NoFreeBlocksError(
                f"need {num_blocks} blocks, have {len(self._free)} free "
                f"and {self._num_idle} idle cached"
            )
        if len(self._free) < num_blocks:
            self._evict(num_blocks - len(self._free))
        blocks = [self._free.take() for _ in range(num_blocks)]
        for block in blocks:
            block.ref_count = 1
        return blocks

    def cache_blocks(
        self,
        block_table: list[Block],
        start: int,
        stop: int,
        block_hashes: Sequence[int],
        token_bytes: bytes | bytearray,
        salt: str | None = None,
        lora: str | None = None,
    ) -> int:
        """Register the full blocks ``block_table[start:stop]``; return how many were.

        The caller pins every block of ``block_table``; ``block_hashes[i]`` and the
        ``i``-th block of ``token_bytes`` (the request's tokens from the start) are
        the identity and the tokens of ``block_table[i]``, whose parent is the entry
        before it. If an identity is already cached with the same tokens (another
        request computed it meanwhile), the caller's copy is released and the cached
        block, now pinned, takes its place in ``block_table``. If it is cached with
        other tokens (a hash collision), registration stops there: that block and
        those after it stay private, and the count returned is short.

        Each run of newly cached blocks is logged as one ``stored`` event hanging off
        the block before it, with its tokens (and ``salt`` and ``lora``, the request's
        cache salt and adapter, when the run starts the prompt).
        """
        step = self.block_size * TOKEN_DTYPE.itemsize
        cached, run = self._cached, _Run(start)
        for index in range(start, stop):
            block_hash, block = block_hashes[index], block_table[index]
            tokens = bytes(token_bytes[index * step : (index + 1) * step])
            existing = cached.get(block_hash)
            if existing is not None:
                if existing.token_bytes != tokens:
                    stop = index
                    break
                self.acquire((existing,))
                self.release((block,))
                block_table[index] = existing
                self._log_stored(run, block_table, salt, lora)
                run = _Run(index + 1)
                continue
            parent = block_table[index - 1] if index else None
            block.block_hash, block.parent, block.token_bytes = block_hash, parent, tokens
            block.depth = index
            block.salt, block.lora = (salt, lora) if index == 0 else (None, None)
            cached[block_hash] = block
            if parent is not None:
                parent.num_children += 1
            run.add(block_hash, tokens)
        self._log_stored(run, block_table, salt, lora)
        return stop - start

    def _log_stored(
        self, run: _Run, block_table: list[Block], salt: str | None, lora: str | None
    ) -> None:
        if not run.hashes:
            return
        self.stats.stored_blocks += len(run.hashes)
        parent = block_table[run.start - 1].block_hash if run.start else None
        depths = tuple(range(run.start, run.start + len(run.hashes)))
        tokens = b"".join(run.tokens)
        salt, lora = (salt, lora) if run.start == 0 else (None, None)
        self.events.append("stored", tuple(run.hashes), parent, depths, "GPU", tokens, salt, lora)

    def release(self, blocks: Iterable[Block]) -> None:
        """Unpin blocks; pass a request's blocks tail first so leaves age before parents."""
        for block in blocks:
            block.ref_count -= 1
            if block.ref_count:
                continue
            self._clock += 1
            block.last_used = self._clock
            if not block.is_cached:
                self._free.append(block)
                continue
            self._num_idle += 1
            if block.num_children == 0:
                self._make_candidate(block)

    def reset(self) -> bool:
        """Forget every cached identity; refused (``False``) while any block is pinned."""
        if any(block.ref_count for block in self._blocks):
            return False
        for block in self._cached.values():
            self._forget(block)
            self._free.append(block)
        self._cached.clear()
        self._candidates.clear()
        self._num_idle = 0
        self.stats = CacheStats()
        self.events.append("cleared")
        return True

    # ---------------------------------------------------------------- internals

    def _make_candidate(self, block: Block) -> None:
        heapq.heappush(self._candidates, (block.last_used, block))
        if len(self._candidates) > 2 * self._num_idle + 1024:
            self._prune_candidates()

    def _prune_candidates(self) -> None:
        """Drop stale heap entries; amortised O(1) per push since the heap halves."""
        live = {b.block_id: (stamp, b) for stamp, b in self._candidates if b.is_evictable}
        self._candidates = [(b.last_used, b) for _, b in live.values()]
        heapq.heapify(self._candidates)

    def _evict(self, num_blocks: int) -> None:
        removed: list[int] = []
        depths: list[int] = []
        evicted: list[EvictedBlock] | None = [] if self.on_evicted else None
        candidates = self._candidates
        victim: Block | None = None
        while len(removed) < num_blocks:
            if victim is None:
                stamp, victim = heapq.heappop(candidates)
                if victim.last_used != stamp or not victim.is_evictable:
                    victim = None  # stale: the block was hit, gained a child, or was evicted
                    continue
            block_hash, parent = victim.block_hash, victim.parent
            removed.append(block_hash)  # type: ignore[arg-type]  # evictable means cached
            depths.append(victim.depth)
            if evicted is not None:
                parent_hash = parent.block_hash if parent is not None else None
                record = (
                    block_hash,
                    parent_hash,
                    victim.token_bytes,
                    victim.depth,
                    victim.salt,
                    victim.lora,
                )
                evicted.append(EvictedBlock(*record))  # type: ignore[arg-type]
            del self._cached[block_hash]  # type: ignore[arg-type]
            victim.block_hash, victim.parent, victim.token_bytes = None, None, b""
            self._num_idle -= 1
            self._free.append(victim)
            victim = None
            if parent is not None:
                parent.num_children -= 1
                if parent.is_evictable:
                    # A parent that became a leaf older than every candidate is the next
                    # victim: take it directly rather than push and pop it.
                    if not candidates or parent.last_used < candidates[0][0]:
                        victim = parent
                    else:
                        self._make_candidate(parent)
        if victim is not None:
            self._make_candidate(victim)  # the chain went on past what was needed
        self.stats.evictions += len(removed)
        self.events.append("removed", tuple(removed), None, tuple(depths))
        if evicted and self.on_evicted is not None:
            self.on_evicted(evicted)

    @staticmethod
    def _forget(block: Block) -> None:
        block.block_hash, block.parent, block.num_children, block.token_bytes = None, None, 0, b""

    # ---------------------------------------------------------------- checking

    def check_invariants(self) -> None:
        """Full O(n) consistency check, for tests and debugging; raises AssertionError."""
        free_ids = {b.block_id for b in self._free.recycled}
        assert len(free_ids) == len(self._free.recycled), "a block is on the free list twice"
        assert len(self._free) + self.num_used_blocks == self.num_blocks
        for block in self._blocks:
            assert block.ref_count >= 0, f"block {block.block_id} has a negative refcount"
            in_free = block.block_id in free_ids
            assert in_free == (block.ref_count == 0 and not block.is_cached), (
                f"block {block.block_id} free-list membership disagrees with its state"
            )
        for block_hash, block in self._cached.items():
            assert block.block_hash == block_hash
            if block.parent is not None:
                assert self._cached.get(block.parent.block_hash) is block.parent, (  # type: ignore[arg-type]
                    f"cached block {block.block_id} outlived its parent"
                )
        children = {h: 0 for h in self._cached}
        for block in self._cached.values():
            if block.parent is not None:
                children[block.parent.block_hash] += 1  # type: ignore[index]
        for block_hash, count in children.items():
            assert self._cached[block_hash].num_children == count
        idle = sum(b.ref_count == 0 for b in self._cached.values())
        assert idle == self._num_idle, (idle, self._num_idle)
        for block in self._cached.values():
            if block.ref_count and block.parent is not None:
                assert block.parent.ref_count, "a pinned block's parent is not pinned"
        live = {id(b) for stamp, b in self._candidates if b.is_evictable and b.last_used == stamp}
        assert live == {id(b) for b in self._cached.values() if b.is_evictable}, (
            "an evictable leaf is missing from the candidate heap"
        )
