"""The cache scenario the prefix cache's tests and the host tier's share: prompts made of
blocks, what an engine does with one, and a naive reference model that a model-based
test drives in step with the real cache (one tier or two)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
from hypothesis import strategies as st

from replica.api.identity import block_hashes
from replica.api.tokenizer import TOKEN_DTYPE
from replica.host_cache import HostCache
from replica.prefix_cache import Block, PrefixCache

BLOCK = 4
#: One block's tokens, in bytes.
STEP = BLOCK * TOKEN_DTYPE.itemsize

Hasher = Callable[[np.ndarray], list[int]]


def tokens_of(*symbols: int) -> np.ndarray:
    """A prompt of one block per symbol; equal symbols at equal positions share blocks."""
    return np.repeat(np.array(symbols, dtype=TOKEN_DTYPE), BLOCK)


def keyed(tokens: np.ndarray) -> tuple[list[int], bytes]:
    """A prompt as a cache takes it: its blocks' identities (tenant 0), its tokens' bytes."""
    return block_hashes(tokens, BLOCK, 0), tokens.tobytes()


def colliding(tokens: np.ndarray) -> list[int]:
    """Block identities that are the blocks' indexes: every prompt collides with every
    other (a collision must cost a miss, never a wrong hit)."""
    return list(range(len(tokens) // BLOCK))


def cached_blocks(cache: PrefixCache, *symbols: int) -> int:
    """How many leading blocks of the prompt the cache holds."""
    return len(cache.match(*keyed(tokens_of(*symbols))))


def admit(
    cache: PrefixCache,
    tokens: np.ndarray,
    hasher: Hasher | None = None,
    *,
    host: HostCache | None = None,
) -> list[Block]:
    """What an engine does for a prompt: pin its hits, allocate and cache the rest. With
    a ``host`` tier, the run of host blocks after the hits is loaded back first (the
    engine keeps at least the last block to compute; here every block)."""
    hashes = hasher(tokens) if hasher else block_hashes(tokens, BLOCK, 0)
    raw = tokens.tobytes()
    hits = cache.match(hashes, raw)
    if host is not None:
        loaded = host.match(hashes, raw, len(hits))
        host.loaded(hashes[len(hits) : len(hits) + loaded])
    cache.acquire(hits)
    blocks = hits + cache.allocate(len(hashes) - len(hits))
    cache.cache_blocks(blocks, len(hits), len(hashes), hashes, raw)
    return blocks


def finish(cache: PrefixCache, blocks: list[Block]) -> None:
    cache.release(reversed(blocks))


# ------------------------------------------------------------- the reference


@dataclass
class RefNode:
    tokens: bytes
    parent: int | None
    ref: int = 0
    last_used: int = 0


def held_run(nodes: dict[int, RefNode], hashes: list[int], raw: bytes, start: int = 0) -> list[int]:
    """The prompt's blocks from index ``start`` that ``nodes`` hold in a row, each with
    the prompt's own tokens (a colliding identity is a miss)."""
    found = []
    for i in range(start, len(hashes)):
        node = nodes.get(hashes[i])
        if node is None or node.tokens != raw[i * STEP : (i + 1) * STEP]:
            break
        found.append(hashes[i])
    return found


def lru_idle_leaf(nodes: dict[int, RefNode]) -> int:
    """The block to evict, found naively: of the unpinned blocks no other hangs off, the
    least recently used."""
    parents = {n.parent for n in nodes.values()}
    idle_leaves = (h for h, n in nodes.items() if n.ref == 0 and h not in parents)
    return min(idle_leaves, key=lambda h: nodes[h].last_used)


@dataclass
class ReferenceCache:
    """The seed's algorithm, naively: scan every block for the LRU idle leaf."""

    num_blocks: int
    nodes: dict[int, RefNode] = field(default_factory=dict)
    clock: int = 0

    @property
    def free(self) -> int:
        return self.num_blocks - len(self.nodes)

    def match(self, hashes: list[int], raw: bytes) -> int:
        return len(held_run(self.nodes, hashes, raw))

    def can_admit(self, hits: list[int], need: int) -> bool:
        idle = sum(n.ref == 0 for h, n in self.nodes.items() if h not in hits)
        return need <= self.free + idle

    def evict_one(self) -> None:
        del self.nodes[lru_idle_leaf(self.nodes)]

    def make_room(self, count: int) -> None:
        """Evict until ``count`` blocks are free, as a new request's allocation does."""
        while self.free < count:
            self.evict_one()

    def admit(self, hashes: list[int], raw: bytes) -> None:
        hits = self.match(hashes, raw)
        for h in hashes[:hits]:
            self.nodes[h].ref += 1
        self.make_room(len(hashes) - hits)
        for i in range(hits, len(hashes)):
            parent = hashes[i - 1] if i else None
            self.nodes[hashes[i]] = RefNode(raw[i * STEP : (i + 1) * STEP], parent, ref=1)

    def release(self, hashes: list[int]) -> None:
        for h in reversed(hashes):
            node = self.nodes[h]
            node.ref -= 1
            if node.ref == 0:
                self.clock += 1
                node.last_used = self.clock


# ------------------------------------------------------------- the scenario

prompts = st.lists(st.integers(0, 2), min_size=1, max_size=5)
#: Admit a prompt (its blocks' symbols), release the running request at an index, or
#: allocate that many blocks and free them again, forcing evictions as a new request would.
operation = st.one_of(
    st.tuples(st.just("admit"), prompts),
    st.tuples(st.just("release"), st.integers(0, 10)),
    st.tuples(st.just("evict"), st.integers(1, 4)),
)
operations = st.lists(operation, max_size=60)


def run_against_reference(
    cache: PrefixCache,
    model: ReferenceCache,
    ops: list[tuple[str, object]],
    admit: Callable[[PrefixCache, np.ndarray], list[Block]] = admit,
    check: Callable[[], None] = lambda: None,
) -> None:
    """Apply ``ops`` to the cache (through ``admit``) and to the model in step. At each
    admission both find the same hits and agree whether it fits; after every operation
    the cache's invariants hold, no pinned block was ever evicted, both hold the same
    blocks, and ``check`` (a second tier's checks) passes."""
    active: list[tuple[list[Block], list[int]]] = []
    for op, arg in ops:
        if op == "admit":
            tokens = tokens_of(*arg)
            hashes, raw = keyed(tokens)
            hits = cache.match(hashes, raw)
            assert len(hits) == model.match(hashes, raw), "hits differ from the reference model"
            need = len(hashes) - len(hits)
            can = cache.can_allocate(need + sum(b.ref_count == 0 for b in hits))
            assert can == model.can_admit(hashes[: len(hits)], need)
            if can:
                active.append((admit(cache, tokens), hashes))
                model.admit(hashes, raw)
        elif op == "release" and active:
            blocks, hashes = active.pop(arg % len(active))
            finish(cache, blocks)
            model.release(hashes)
        elif op == "evict" and cache.can_allocate(arg):
            cache.release(cache.allocate(arg))
            model.make_room(arg)
        cache.check_invariants()  # free + used == total, parents outlive children, ...
        assert cache.num_free_blocks + cache.num_used_blocks == model.num_blocks
        for blocks, hashes in active:  # no pinned block was ever evicted
            assert [b.block_hash for b in blocks] == hashes
        assert set(model.nodes) == {b.block_hash for b in cache._cached.values()}
        check()
