"""``make bench``: speed of the prefix cache and of the engine's scheduling.

Prints, for caches of 10k and 1M blocks: match throughput, insert throughput and
eviction cost per block, beside the seed chapter's scan-and-sort eviction; then the
engine's scheduling overhead per step with 64 running sequences. Every figure is the
median of several repeats measured in this one run (this machine is shared).
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from replica.api.tokenizer import TOKEN_DTYPE
from replica.engine import Engine, EngineConfig
from replica.prefix_cache import Block, PrefixCache
from replica.sequence import EngineRequest

BLOCK_SIZE = 16
CHAIN = 64  # blocks per prompt: a 1,024-token prompt
STEP = BLOCK_SIZE * TOKEN_DTYPE.itemsize


def median_time(
    run: Callable[[], int], repeats: int, setup: Callable[[], object] = lambda: None
) -> float:
    """Median seconds per unit of work; ``run`` returns how many units it did.
    ``setup`` runs before every repeat, untimed."""
    samples = []
    for _ in range(repeats):
        setup()
        gc.collect()
        start = time.perf_counter()
        units = run()
        samples.append((time.perf_counter() - start) / units)
    return statistics.median(samples)


@dataclass
class Chain:
    hashes: list[int]
    raw: bytes


def make_chains(count: int, rng: np.random.Generator) -> list[Chain]:
    tokens = rng.integers(0, 2**32, (count, CHAIN * BLOCK_SIZE), dtype=np.uint64).astype(
        TOKEN_DTYPE
    )
    hashes = rng.integers(0, 2**63, (count, CHAIN), dtype=np.int64)
    return [Chain(hashes[i].tolist(), tokens[i].tobytes()) for i in range(count)]


def insert_chain(cache: PrefixCache, chain: Chain) -> list[Block]:
    blocks = cache.allocate(CHAIN)
    cache.cache_blocks(blocks, 0, CHAIN, chain.hashes, chain.raw)
    return blocks


def filled_cache(num_blocks: int, rng: np.random.Generator) -> tuple[PrefixCache, list[Chain]]:
    cache = PrefixCache(num_blocks, BLOCK_SIZE, max_events=1024)
    chains = make_chains(num_blocks // CHAIN, rng)
    for chain in chains:
        cache.release(reversed(insert_chain(cache, chain)))
    return cache, chains


def bench_cache(num_blocks: int, repeats: int, rng: np.random.Generator) -> dict[str, float]:
    cache, chains = filled_cache(num_blocks, rng)
    probes = [chains[i] for i in rng.integers(0, len(chains), 200)]

    def match() -> int:
        return sum(len(cache.match(c.hashes, c.raw)) for c in probes)

    taken: list[Block] = []

    def fill_with_idle_chains() -> None:
        """Untimed: the blocks the last repeat took come back cached and idle, so the
        cache is full of idle cached chains again (an evictable leaf at each end)."""
        cache.release(taken)  # never registered: back to the free list
        taken.clear()
        for chain in [next(to_evict) for _ in range(8)]:
            cache.release(reversed(insert_chain(cache, chain)))
        assert cache.num_free_blocks == 0 and cache.num_idle_blocks == cache.num_blocks

    evicted = [0]

    def evict() -> int:
        before = cache.stats.evictions
        taken.extend(cache.allocate(8 * CHAIN))  # no free block: every one is an eviction
        evicted[0] += cache.stats.evictions - before
        return 8 * CHAIN

    def insert() -> int:
        blocks = cache.allocate(8 * CHAIN)
        cache.release(blocks)  # pre-evicted: insert_chain below only registers
        for chain in [next(fresh) for _ in range(8)]:
            cache.release(reversed(insert_chain(cache, chain)))
        return 8 * CHAIN

    fresh = iter(make_chains(repeats * 8 + 8, rng))
    to_evict = iter(make_chains(repeats * 8, rng))
    figures = {
        "match_blocks_per_s": 1 / median_time(match, repeats),
        "insert_blocks_per_s": 1 / median_time(insert, repeats),
    }
    figures["evict_us_per_block"] = 1e6 * median_time(evict, repeats, fill_with_idle_chains)
    # Every repeat evicted every block it took (the figure times eviction, nothing else).
    assert evicted[0] == repeats * 8 * CHAIN, evicted
    return figures


class SeedCache:
    """The seed chapter's structure and eviction: scan all, keep idle leaves, sort by age."""

    @dataclass
    class Node:
        hash: int
        parent_hash: int | None
        ref_count: int
        last_used: int

    def __init__(self, chains: list[Chain]) -> None:
        self.cache: dict[int, SeedCache.Node] = {}
        clock = 0
        for chain in chains:
            parent = None
            for h in chain.hashes:
                clock += 1
                self.cache[h] = SeedCache.Node(h, parent, 0, clock)
                parent = h

    def evict(self, n_needed: int) -> None:
        has_cached_child = {node.parent_hash for node in self.cache.values()}
        candidates = [
            node
            for h, node in self.cache.items()
            if node.ref_count == 0 and h not in has_cached_child
        ]
        candidates.sort(key=lambda n: n.last_used)
        for node in candidates[:n_needed]:
            del self.cache[node.hash]


def bench_seed_eviction(num_blocks: int, repeats: int, rng: np.random.Generator) -> float:
    seed = SeedCache(make_chains(num_blocks // CHAIN, rng))

    def evict() -> int:
        seed.evict(CHAIN)  # one request's worth of blocks per call, as an engine would
        return CHAIN

    return 1e6 * median_time(evict, repeats)


def bench_engine_step(repeats: int) -> float:
    engine = Engine(EngineConfig(num_blocks=16384))
    for i in range(64):
        prompt = np.arange(i * 1000, i * 1000 + 512, dtype=TOKEN_DTYPE)
        engine.add_request(EngineRequest(f"r{i}", prompt, 100_000, ignore_eos=True))
    while engine.scheduler.waiting or any(
        s.num_uncomputed_tokens > 1 for s in engine.scheduler.running
    ):
        engine.step()

    def steps() -> int:
        for _ in range(200):
            engine.step()
        return 200

    return 1e6 * median_time(steps, repeats)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sizes", default="10000,1000000", help="cache sizes in blocks")
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args(argv)
    rng = np.random.default_rng(0)
    sizes = [int(s) for s in args.sizes.split(",")]
    print(
        f"{'blocks':>9} | {'match blocks/s':>14} | {'insert blocks/s':>15} | "
        f"{'evict us/block':>14} | {'seed evict us/block':>19} | {'seed / ours':>11}"
    )
    evict_costs = []
    for size in sizes:
        ours = bench_cache(size, args.repeats, rng)
        seed = bench_seed_eviction(size, max(3, args.repeats // 2), rng)
        evict_costs.append(ours["evict_us_per_block"])
        evict = ours["evict_us_per_block"]
        print(
            f"{size:>9} | {ours['match_blocks_per_s']:>14,.0f} | "
            f"{ours['insert_blocks_per_s']:>15,.0f} | "
            f"{evict:>14.3f} | {seed:>19.3f} | {seed / evict:>10.0f}x"
        )
    if len(evict_costs) > 1:
        print(
            f"eviction cost per block, {sizes[-1]:,} vs {sizes[0]:,} blocks: "
            f"{evict_costs[-1] / evict_costs[0]:.2f}x (goal: within 3x)"
        )
    step_us = bench_engine_step(args.repeats)
    print(f"engine scheduling overhead per step, 64 running sequences: {step_us:.0f} us")


if __name__ == "__main__":
    main()
