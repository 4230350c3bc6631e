"""The host tier under the GPU pool: demotion, loads, leaf-first LRU, events, and a
model-based test of both tiers against a naive reference."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from replica.api.identity import block_hashes
from replica.api.tokenizer import TOKEN_DTYPE
from replica.host_cache import HostCache
from replica.prefix_cache import Block, PrefixCache
from tests.replica.test_prefix_cache import (
    BLOCK,
    ReferenceCache,
    RefNode,
    finish,
    operation,
    tokens_of,
)

STEP = BLOCK * TOKEN_DTYPE.itemsize


def tiers(gpu_blocks: int, host_blocks: int) -> tuple[PrefixCache, HostCache]:
    cache = PrefixCache(num_blocks=gpu_blocks, block_size=BLOCK)
    host = HostCache(host_blocks, BLOCK, cache.events)
    cache.on_evicted = host.store
    return cache, host


def admit_two_tiers(cache: PrefixCache, host: HostCache, tokens: np.ndarray) -> list[Block]:
    """What the scheduler does: pin the GPU hits, load the host run that follows, compute
    the rest (the engine keeps at least the last block to compute; here every block)."""
    hashes, raw = block_hashes(tokens, BLOCK, 0), tokens.tobytes()
    hits = cache.match(hashes, raw)
    loaded = host.match(hashes, raw, len(hits))
    host.loaded(hashes[len(hits) : len(hits) + loaded])
    cache.acquire(hits)
    blocks = hits + cache.allocate(len(hashes) - len(hits))
    cache.cache_blocks(blocks, len(hits), len(hashes), hashes, raw)
    return blocks


def held(cache: PrefixCache, host: HostCache, *symbols: int) -> tuple[int, int]:
    """Leading blocks of the prompt on the GPU, and how many more on the host."""
    tokens = tokens_of(*symbols)
    hashes, raw = block_hashes(tokens, BLOCK, 0), tokens.tobytes()
    gpu = len(cache.match(hashes, raw))
    return gpu, host.match(hashes, raw, gpu)


def test_gpu_eviction_demotes_to_the_host_and_a_load_brings_it_back():
    cache, host = tiers(gpu_blocks=4, host_blocks=8)
    finish(cache, admit_two_tiers(cache, host, tokens_of(1, 2, 3, 4)))
    finish(cache, admit_two_tiers(cache, host, tokens_of(5, 6, 7, 8)))  # evicts 1-4
    assert held(cache, host, 1, 2, 3, 4) == (0, 4)
    assert host.stats.stored_blocks == 4
    blocks = admit_two_tiers(cache, host, tokens_of(1, 2, 3, 4))  # loads 1-4, demotes 5-8
    assert host.stats.loaded_blocks == 4 and all(b.is_cached for b in blocks)
    finish(cache, blocks)
    assert held(cache, host, 1, 2, 3, 4) == (4, 0)
    assert host.stats.stored_blocks == 8
    # The host kept its copy of 1-4: evicting them from the GPU again copies nothing.
    finish(cache, admit_two_tiers(cache, host, tokens_of(5, 6, 7, 8)))
    assert host.stats.stored_blocks == 8 and host.stats.loaded_blocks == 8 and len(host) == 8
    cache.check_invariants()
    host.check_invariants()


def test_the_host_evicts_leaves_first_least_recently_used_first():
    cache, host = tiers(gpu_blocks=3, host_blocks=4)
    finish(cache, admit_two_tiers(cache, host, tokens_of(1, 2, 3)))
    finish(cache, admit_two_tiers(cache, host, tokens_of(1, 2, 4)))  # demotes 3
    finish(cache, admit_two_tiers(cache, host, tokens_of(5, 6, 7)))  # demotes 4, 2, 1
    assert len(host) == 4 and host.stats.evictions == 0
    finish(cache, admit_two_tiers(cache, host, tokens_of(8, 9, 10)))  # demotes 7, 6, 5
    # The oldest leaves go first (3, then 4); 2 only once both its children are gone,
    # and 1, the root of what is left, stays.
    assert host.stats.evictions == 3
    assert held(cache, host, 1, 2, 3) == (0, 1)
    assert held(cache, host, 5, 6, 7) == (0, 3)
    host.check_invariants()
    cache.check_invariants()


def test_events_say_which_tier_and_chains_hang_off_their_parents():
    cache, host = tiers(gpu_blocks=3, host_blocks=8)
    finish(cache, admit_two_tiers(cache, host, tokens_of(1, 2, 3)))
    finish(cache, admit_two_tiers(cache, host, tokens_of(4, 5, 6)))
    events, _ = cache.events_since(0)
    assert [(e.kind, e.medium) for e in events] == [
        ("stored", "GPU"), ("removed", "GPU"), ("stored", "CPU"), ("stored", "GPU"),
    ]  # fmt: skip
    demoted = events[2]
    first = block_hashes(tokens_of(1, 2, 3), BLOCK, 0)
    assert demoted.block_hashes == tuple(first) and demoted.parent_hash is None
    assert demoted.block_depths == (0, 1, 2)
    assert cache.reset()
    host.reset()
    assert [e.kind for e in cache.events_since(events[-1].seq)[0]] == ["cleared"]
    assert len(host) == 0


def test_a_collision_on_the_host_is_a_miss():
    cache, host = tiers(gpu_blocks=2, host_blocks=4)

    def colliding(tokens: np.ndarray) -> list[int]:
        return list(range(len(tokens) // BLOCK))

    hashes, raw = colliding(tokens_of(1, 2)), tokens_of(1, 2).tobytes()
    blocks = cache.allocate(2)
    cache.cache_blocks(blocks, 0, 2, hashes, raw)
    finish(cache, blocks)
    cache.release(cache.allocate(2))  # demotes both
    assert len(host) == 2
    other = tokens_of(3, 4)
    assert host.match(colliding(other), other.tobytes(), 0) == 0
    assert host.match(hashes, raw, 0) == 2


def test_tenants_never_share_host_blocks():
    cache, host = tiers(gpu_blocks=2, host_blocks=4)
    tokens = tokens_of(1, 2)
    acme, globex = block_hashes(tokens, BLOCK, 11), block_hashes(tokens, BLOCK, 22)
    blocks = cache.allocate(2)
    cache.cache_blocks(blocks, 0, 2, acme, tokens.tobytes())
    finish(cache, blocks)
    cache.release(cache.allocate(2))
    assert host.match(acme, tokens.tobytes(), 0) == 2
    assert host.match(globex, tokens.tobytes(), 0) == 0


# ----------------------------------------------------------- property-based


@dataclass
class ReferenceHost:
    """The host tier, naively: scan every block for the LRU leaf."""

    num_blocks: int
    nodes: dict[int, RefNode] = field(default_factory=dict)
    clock: int = 0

    def touch(self, block_hash: int) -> None:
        self.clock += 1
        self.nodes[block_hash].last_used = self.clock

    def store(self, block_hash: int, parent: int | None, tokens: bytes) -> None:
        if block_hash in self.nodes:
            self.touch(block_hash)
            return
        if len(self.nodes) >= self.num_blocks:
            parents = {n.parent for n in self.nodes.values()}
            leaves = [h for h in self.nodes if h not in parents]
            del self.nodes[min(leaves, key=lambda h: self.nodes[h].last_used)]
        self.nodes[block_hash] = RefNode(tokens, parent)
        self.touch(block_hash)

    def match(self, hashes: list[int], raw: bytes, start: int) -> int:
        found = []
        for i in range(start, len(hashes)):
            node = self.nodes.get(hashes[i])
            if node is None or node.tokens != raw[i * STEP : (i + 1) * STEP]:
                break
            found.append(hashes[i])
        for block_hash in reversed(found):
            self.touch(block_hash)
        return len(found)


class TwoTierReference(ReferenceCache):
    """The GPU reference, whose evictions go to a reference host tier."""

    host: ReferenceHost

    def evict_one(self) -> None:
        parents = {n.parent for n in self.nodes.values()}
        victim = min(
            (h for h, n in self.nodes.items() if n.ref == 0 and h not in parents),
            key=lambda h: self.nodes[h].last_used,
        )
        node = self.nodes.pop(victim)
        if victim >= 0:  # not one of the test's anonymous blocks
            self.host.store(victim, node.parent, node.tokens)

    def admit(self, hashes: list[int], raw: bytes) -> None:
        hits = self.match(hashes, raw)
        self.host.match(hashes, raw, hits)
        for h in hashes[:hits]:
            self.nodes[h].ref += 1
        while self.free < len(hashes) - hits:
            self.evict_one()
        for i in range(hits, len(hashes)):
            parent = hashes[i - 1] if i else None
            self.nodes[hashes[i]] = RefNode(raw[i * STEP : (i + 1) * STEP], parent, ref=1)


#: Long interleavings: a block must travel GPU -> host -> GPU -> host for some cases.
long_operations = st.lists(operation, min_size=30, max_size=80)


@settings(max_examples=400, deadline=None)
@given(capacity=st.integers(5, 10), host_capacity=st.integers(2, 8), ops=long_operations)
def test_two_tiers_keep_every_invariant_and_match_the_reference(capacity, host_capacity, ops):
    cache, host = tiers(capacity, host_capacity)
    model = TwoTierReference(capacity)
    model.host = ReferenceHost(host_capacity)
    active: list[tuple[list[Block], list[int]]] = []
    for op, arg in ops:
        if op == "admit":
            tokens = tokens_of(*arg)
            hashes, raw = block_hashes(tokens, BLOCK, 0), tokens.tobytes()
            hits = cache.match(hashes, raw)
            need = len(hashes) - len(hits)
            if cache.can_allocate(need + sum(b.ref_count == 0 for b in hits)):
                active.append((admit_two_tiers(cache, host, tokens), hashes))
                model.admit(hashes, raw)
        elif op == "release" and active:
            blocks, hashes = active.pop(arg % len(active))
            finish(cache, blocks)
            model.release(hashes)
        elif op == "evict" and cache.can_allocate(arg):
            taken = cache.allocate(arg)  # forces evictions like a new request would
            cache.release(taken)
            while model.free < arg:
                model.evict_one()
        cache.check_invariants()
        host.check_invariants()
        for blocks, hashes in active:  # no block in use ever left the GPU
            assert [b.block_hash for b in blocks] == hashes
        assert set(model.nodes) == {b.block_hash for b in cache._cached.values()}
        assert set(model.host.nodes) == set(host._blocks), "host tier differs from the model"
        for block_hash, node in model.host.nodes.items():  # tokens kept for the check
            assert host._blocks[block_hash].token_bytes == node.tokens
