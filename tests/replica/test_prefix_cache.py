"""The prefix cache: hits, leaf-only LRU, pinning, collisions, statistics, events."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from replica.event_log import EventLog
from replica.prefix_cache import NoFreeBlocksError, PrefixCache
from tests.replica.cache_model import (
    BLOCK,
    ReferenceCache,
    admit,
    cached_blocks,
    colliding,
    finish,
    keyed,
    operations,
    run_against_reference,
    tokens_of,
)


@pytest.fixture
def cache():
    cache = PrefixCache(num_blocks=8, block_size=BLOCK)
    yield cache
    cache.check_invariants()


def test_a_repeated_prompt_hits_every_block(cache):
    finish(cache, admit(cache, tokens_of(1, 2, 3)))
    assert cached_blocks(cache, 1, 2, 3) == 3


def test_a_hit_is_the_longest_run_of_leading_cached_blocks(cache):
    finish(cache, admit(cache, tokens_of(1, 2, 3)))
    assert cached_blocks(cache, 1, 2, 9, 3) == 2


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
    assert cache.stats.evictions == 1
    assert cached_blocks(cache, 1, 2, 3) == 2  # the oldest leaf went; its parents stay for 1, 2, 4
    assert cached_blocks(cache, 1, 2, 4) == 3 and cached_blocks(cache, 5, 6) == 2


def test_the_shared_system_prompt_survives_any_churn_hanging_off_it():
    cache = PrefixCache(num_blocks=12, block_size=BLOCK)
    system = (7, 7, 7)
    rng = np.random.default_rng(0)
    for conversation in range(500):
        tail = tuple(int(x) for x in rng.integers(10, 10_000, rng.integers(1, 8)))
        blocks = admit(cache, tokens_of(*system, *tail))
        finish(cache, blocks)
        lost = f"system prompt lost after conversation {conversation}"
        assert cached_blocks(cache, *system) == 3, lost
    assert cache.stats.evictions > 1000
    cache.check_invariants()


def test_a_hash_collision_is_a_miss_never_a_wrong_hit(cache):
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
    assert cache.match(*keyed(tokens_of(1, 2))) == first  # a second request's hits
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


@settings(max_examples=300, deadline=None)
@given(capacity=st.integers(5, 12), ops=operations)
def test_random_interleavings_keep_every_invariant_and_match_the_reference(capacity, ops):
    cache = PrefixCache(num_blocks=capacity, block_size=BLOCK)
    run_against_reference(cache, ReferenceCache(capacity), ops)


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
