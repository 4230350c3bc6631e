"""The host tier under the GPU pool: demotion, loads, leaf-first LRU, events, and a
model-based test of both tiers against a naive reference."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial

from hypothesis import given, settings
from hypothesis import strategies as st

from replica.api.identity import block_hashes
from replica.host_cache import HostCache
from replica.prefix_cache import PrefixCache
from tests.replica.cache_model import (
    BLOCK,
    ReferenceCache,
    RefNode,
    admit,
    colliding,
    finish,
    held_run,
    keyed,
    lru_idle_leaf,
    operation,
    run_against_reference,
    tokens_of,
)


def tiers(gpu_blocks: int, host_blocks: int) -> tuple[PrefixCache, HostCache]:
    cache = PrefixCache(num_blocks=gpu_blocks, block_size=BLOCK)
    host = HostCache(host_blocks, BLOCK, cache.events)
    cache.on_evicted = host.store
    return cache, host


def held(cache: PrefixCache, host: HostCache, *symbols: int) -> tuple[int, int]:
    """Leading blocks of the prompt on the GPU, and how many more on the host."""
    hashes, raw = keyed(tokens_of(*symbols))
    gpu = len(cache.match(hashes, raw))
    return gpu, host.match(hashes, raw, gpu)


def test_gpu_eviction_demotes_to_the_host_and_a_load_brings_it_back():
    cache, host = tiers(gpu_blocks=4, host_blocks=8)
    finish(cache, admit(cache, tokens_of(1, 2, 3, 4), host=host))
    finish(cache, admit(cache, tokens_of(5, 6, 7, 8), host=host))  # evicts 1-4
    assert held(cache, host, 1, 2, 3, 4) == (0, 4)
    assert host.stats.stored_blocks == 4
    blocks = admit(cache, tokens_of(1, 2, 3, 4), host=host)  # loads 1-4, demotes 5-8
    assert host.stats.loaded_blocks == 4 and all(b.is_cached for b in blocks)
    finish(cache, blocks)
    assert held(cache, host, 1, 2, 3, 4) == (4, 0)
    assert host.stats.stored_blocks == 8
    # The host kept its copy of 1-4: evicting them from the GPU again copies nothing.
    finish(cache, admit(cache, tokens_of(5, 6, 7, 8), host=host))
    assert host.stats.stored_blocks == 8 and host.stats.loaded_blocks == 8 and len(host) == 8
    cache.check_invariants()
    host.check_invariants()


def test_the_host_evicts_leaves_first_least_recently_used_first():
    cache, host = tiers(gpu_blocks=3, host_blocks=4)
    finish(cache, admit(cache, tokens_of(1, 2, 3), host=host))
    finish(cache, admit(cache, tokens_of(1, 2, 4), host=host))  # demotes 3
    finish(cache, admit(cache, tokens_of(5, 6, 7), host=host))  # demotes 4, 2, 1
    assert len(host) == 4 and host.stats.evictions == 0
    finish(cache, admit(cache, tokens_of(8, 9, 10), host=host))  # demotes 7, 6, 5
    # The oldest leaves go first (3, then 4); 2 only once both its children are gone,
    # and 1, the root of what is left, stays.
    assert host.stats.evictions == 3
    assert held(cache, host, 1, 2, 3) == (0, 1)
    assert held(cache, host, 5, 6, 7) == (0, 3)
    host.check_invariants()
    cache.check_invariants()


def test_events_say_which_tier_and_chains_hang_off_their_parents():
    cache, host = tiers(gpu_blocks=3, host_blocks=8)
    finish(cache, admit(cache, tokens_of(1, 2, 3), host=host))
    finish(cache, admit(cache, tokens_of(4, 5, 6), host=host))
    events, _ = cache.events_since(0)
    kinds = [(e.kind, e.medium) for e in events]
    assert kinds == [("stored", "GPU"), ("removed", "GPU"), ("stored", "CPU"), ("stored", "GPU")]
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
            del self.nodes[lru_idle_leaf(self.nodes)]  # host blocks are never pinned
        self.nodes[block_hash] = RefNode(tokens, parent)
        self.touch(block_hash)

    def match(self, hashes: list[int], raw: bytes, start: int) -> int:
        found = held_run(self.nodes, hashes, raw, start)
        for block_hash in reversed(found):
            self.touch(block_hash)
        return len(found)


class TwoTierReference(ReferenceCache):
    """The GPU reference, whose evictions go to a reference host tier."""

    def __init__(self, num_blocks: int, host_blocks: int) -> None:
        super().__init__(num_blocks)
        self.host = ReferenceHost(host_blocks)

    def evict_one(self) -> None:
        victim = lru_idle_leaf(self.nodes)
        node = self.nodes.pop(victim)
        self.host.store(victim, node.parent, node.tokens)

    def admit(self, hashes: list[int], raw: bytes) -> None:
        self.host.match(hashes, raw, self.match(hashes, raw))  # the run it loads back
        super().admit(hashes, raw)


#: Long interleavings: a block must travel GPU -> host -> GPU -> host for some cases.
long_operations = st.lists(operation, min_size=30, max_size=80)


@settings(max_examples=400, deadline=None)
@given(capacity=st.integers(5, 10), host_capacity=st.integers(2, 8), ops=long_operations)
def test_two_tiers_keep_every_invariant_and_match_the_reference(capacity, host_capacity, ops):
    cache, host = tiers(capacity, host_capacity)
    model = TwoTierReference(capacity, host_capacity)

    def host_matches_the_model() -> None:
        host.check_invariants()
        assert set(model.host.nodes) == set(host._blocks), "host tier differs from the model"
        for block_hash, node in model.host.nodes.items():  # tokens kept for the check
            assert host._blocks[block_hash].token_bytes == node.tokens

    run_against_reference(cache, model, ops, partial(admit, host=host), host_matches_the_model)
