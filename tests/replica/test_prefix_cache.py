"""The prefix cache: hits, leaf-only LRU, pinning, collisions, statistics, events."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from replica.api.identity import block_hashes
from replica.api.tokenizer import TOKEN_DTYPE
from replica.event_log import EventLog
from replica.prefix_cache import Block, NoFreeBlocksError, PrefixCache

BLOCK = 4


def tokens_of(*symbols: int) -> np.ndarray:
    """A prompt of one block per symbol; equal symbols at equal positions share blocks."""
    return np.repeat(np.array(symbols, dtype=TOKEN_DTYPE), BLOCK)


def admit(cache: PrefixCache, tokens: np.ndarray, hasher=None) -> list[Block]:
    """What an engine does for a prompt: pin its hits, allocate and cache the rest."""
    hashes = (hasher or (lambda t: block_hashes(t, BLOCK, 0)))(tokens)
    raw = tokens.tobytes()
    hits = cache.match(hashes, raw)
    cache.acquire(hits)
    blocks = hits + cache.allocate(len(hashes) - len(hits))
    cache.cache_blocks(blocks, len(hits), len(hashes), hashes, raw)
    return blocks


def finish(cache: PrefixCache, blocks: list[Block]) -> None:
    cache.release(reversed(blocks))


@pytest.fixture
def cache():
    cache = PrefixCache(num_blocks=8, block_size=BLOCK)
    yield cache
    cache.check_invariants()


def test_a_repeated_prompt_hits_every_block(cache):
    finish(cache, admit(cache, tokens_of(1, 2, 3)))
    hits = cache.match(block_hashes(tokens_of(1, 2, 3), BLOCK, 0), tokens_of(1, 2, 3).tobytes())
    assert len(hits) == 3


def test_a_hit_is_the_longest_run_of_leading_cached_blocks(cache):
    finish(cache, admit(cache, tokens_of(1, 2, 3)))
    prompt = tokens_of(1, 2, 9, 3)
    assert len(cache.match(block_hashes(prompt, BLOCK, 0), prompt.tobytes())) == 2


def test_blocks_of_a_running_request_are_pinned(cache):
    running = admit(cache, tokens_of(1, 2, 3, 4))
    finish(cache, admit(cache, tokens_of(5, 6, 7, 8)))
    admit(cache, tokens_of(9, 9, 9, 9))  # needs 4 blocks: must evict the finished request
    for block in running:
        assert block.is_cached and block.ref_count == 1
    with pytest.raises(NoFreeBlocksError):
        cache.allocate(1)


def test_eviction_takes_leaves_only_and_least_recently_used_first(cache):
    finish(cache, admit(cache, tokens_of(1, 2, 3)))  # older
    finish(cache, admit(cache, tokens_of(1, 2, 4)))  # newer, shares two blocks
    finish(cache, admit(cache, tokens_of(5, 6)))
    assert cache.num_free_blocks == 2
    finish(cache, cache.allocate(3))  # two free blocks and one eviction

    def cached_blocks(*symbols: int) -> int:
        prompt = tokens_of(*symbols)
        return len(cache.match(block_hashes(prompt, BLOCK, 0), prompt.tobytes()))

    assert cache.stats.evictions == 1
    assert cached_blocks(1, 2, 3) == 2  # the oldest leaf went; its parents stay for (1, 2, 4)
    assert cached_blocks(1, 2, 4) == 3 and cached_blocks(5, 6) == 2


def test_the_shared_system_prompt_survives_any_churn_hanging_off_it():
    cache = PrefixCache(num_blocks=12, block_size=BLOCK)
    system = (7, 7, 7)
    rng = np.random.default_rng(0)
    for conversation in range(500):
        tail = tuple(int(x) for x in rng.integers(10, 10_000, rng.integers(1, 8)))
        blocks = admit(cache, tokens_of(*system, *tail))
        finish(cache, blocks)
        system_hits = cache.match(
            block_hashes(tokens_of(*system), BLOCK, 0), tokens_of(*system).tobytes()
        )
        assert len(system_hits) == 3, f"system prompt lost after conversation {conversation}"
    assert cache.stats.evictions > 1000
    cache.check_invariants()


def test_a_hash_collision_is_a_miss_never_a_wrong_hit(cache):
    def colliding(tokens: np.ndarray) -> list[int]:
        return list(range(len(tokens) // BLOCK))  # identity = block index: always collides

    finish(cache, admit(cache, tokens_of(1, 2), colliding))
    other = tokens_of(3, 4)
    assert cache.match(colliding(other), other.tobytes()) == []
    # The colliding blocks are computed privately and never replace the cached ones.
    blocks = admit(cache, other, colliding)
    assert not blocks[0].is_cached
    finish(cache, blocks)
    assert len(cache.match(colliding(tokens_of(1, 2)), tokens_of(1, 2).tobytes())) == 2


def test_a_block_computed_twice_is_deduplicated(cache):
    first = admit(cache, tokens_of(1, 2))
    second_hits = cache.match(block_hashes(tokens_of(1, 2), BLOCK, 0), tokens_of(1, 2).tobytes())
    assert second_hits == first
    # A request that computed the same block privately swaps to the cached one.
    mine = cache.allocate(1)
    private = mine[0]
    assert cache.cache_blocks(mine, 0, 1, [first[0].block_hash], first[0].token_bytes) == 1
    assert mine[0] is first[0] and first[0].ref_count == 2
    assert private.ref_count == 0 and not private.is_cached
    finish(cache, first)
    finish(cache, mine)


def test_statistics_and_usage(cache):
    blocks = admit(cache, tokens_of(1, 2, 3))
    assert cache.stats.stored_blocks == 3
    assert cache.num_used_blocks == 3 and cache.num_free_blocks == 5
    assert cache.usage == pytest.approx(3 / 8)
    finish(cache, blocks)
    assert cache.usage == 0.0 and cache.num_idle_blocks == 3


def test_event_log_records_stored_removed_and_cleared_with_sequence_numbers(cache):
    finish(cache, admit(cache, tokens_of(1, 2, 3, 4, 5, 6, 7, 8)))
    finish(cache, admit(cache, tokens_of(9)))
    events, lost = cache.events_since(0)
    assert not lost
    assert [e.seq for e in events] == list(range(1, len(events) + 1))
    assert [e.kind for e in events] == ["stored", "removed", "stored"]
    assert len(events[0].block_hashes) == 8 and events[0].parent_hash is None
    assert len(events[1].block_hashes) == 1
    assert cache.reset()
    tail, _ = cache.events_since(events[-1].seq)
    assert [e.kind for e in tail] == ["cleared"]
    assert cache.num_cached_blocks == 0 and cache.num_free_blocks == 8


def test_reset_is_refused_while_a_block_is_pinned(cache):
    blocks = admit(cache, tokens_of(1))
    assert not cache.reset()
    finish(cache, blocks)
    assert cache.reset()


def test_a_consumer_that_fell_behind_is_told_to_resync():
    cache = PrefixCache(num_blocks=4, block_size=BLOCK, max_events=2)
    for symbol in range(10):
        finish(cache, admit(cache, tokens_of(symbol)))
    events, lost = cache.events_since(0)
    assert lost and events and events[-1].seq == cache.last_event_seq


# ----------------------------------------------------------- property-based


@dataclass
class RefNode:
    tokens: bytes
    parent: int | None
    ref: int = 0
    last_used: int = 0


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
        step = BLOCK * TOKEN_DTYPE.itemsize
        count = 0
        for i, h in enumerate(hashes):
            node = self.nodes.get(h)
            if node is None or node.tokens != raw[i * step : (i + 1) * step]:
                break
            count += 1
        return count

    def can_admit(self, hits: list[int], need: int) -> bool:
        idle = sum(n.ref == 0 for h, n in self.nodes.items() if h not in hits)
        return need <= self.free + idle

    def admit(self, hashes: list[int], raw: bytes) -> None:
        hits = self.match(hashes, raw)
        for h in hashes[:hits]:
            self.nodes[h].ref += 1
        while self.free < len(hashes) - hits:
            parents = {n.parent for n in self.nodes.values()}
            victim = min(
                (h for h, n in self.nodes.items() if n.ref == 0 and h not in parents),
                key=lambda h: self.nodes[h].last_used,
            )
            del self.nodes[victim]
        step = BLOCK * TOKEN_DTYPE.itemsize
        for i in range(hits, len(hashes)):
            parent = hashes[i - 1] if i else None
            self.nodes[hashes[i]] = RefNode(raw[i * step : (i + 1) * step], parent, ref=1)

    def release(self, hashes: list[int]) -> None:
        for h in reversed(hashes):
            node = self.nodes[h]
            node.ref -= 1
            if node.ref == 0:
                self.clock += 1
                node.last_used = self.clock


prompts = st.lists(st.integers(0, 2), min_size=1, max_size=5)
operation = st.one_of(
    st.tuples(st.just("admit"), prompts),
    st.tuples(st.just("release"), st.integers(0, 10)),
    st.tuples(st.just("evict"), st.integers(1, 4)),
)
operations = st.lists(operation, max_size=60)


@settings(max_examples=300, deadline=None)
@given(capacity=st.integers(5, 12), ops=operations)
def test_random_interleavings_keep_every_invariant_and_match_the_reference(capacity, ops):
    cache = PrefixCache(num_blocks=capacity, block_size=BLOCK)
    model = ReferenceCache(capacity)
    active: list[tuple[list[Block], list[int]]] = []
    for op, arg in ops:
        if op == "admit":
            tokens = tokens_of(*arg)
            hashes, raw = block_hashes(tokens, BLOCK, 0), tokens.tobytes()
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
            cache.release(cache.allocate(arg))  # forces evictions like a new request would
            model.admit([-1 - i for i in range(arg)], b"\0" * arg * BLOCK * 4)
            model.release([-1 - i for i in range(arg)])
            for i in range(arg):
                del model.nodes[-1 - i]
        cache.check_invariants()  # free + used == total, parents outlive children, ...
        assert cache.num_free_blocks + cache.num_used_blocks == capacity
        for blocks, hashes in active:  # no pinned block was ever evicted
            assert [b.block_hash for b in blocks] == hashes
        assert set(model.nodes) == {b.block_hash for b in cache._cached.values()}


def test_a_drained_event_log_keeps_nothing_and_numbers_on():
    log = EventLog(max_events=10)
    for _ in range(3):
        log.append("removed", (1,))
    assert [e.seq for e in log.drain()] == [1, 2, 3]
    assert log.drain() == []
    log.append("removed", (2,))
    assert [e.seq for e in log.drain()] == [4]
    events, lost = log.since(0)  # a reader that relied on the log is told it lost them
    assert events == [] and lost
