"""Memory of a precise prefix index at fleet scale.

Fills a ``PrefixIndex`` in precise mode with full caches, as the replicas' KV events
would: ``--replicas`` replicas of ``--blocks`` GPU blocks each, every replica holding
its own prompts of ``--prompt-blocks`` blocks (the worst case: nothing shared), then
prints the process's resident memory added, per cached block and in total. The
index keeps a key per ``stride`` blocks (which replicas hold it) and, per replica,
where the router's chain stands for every block the engine named (to key the next
event and to forget removed blocks).
"""

from __future__ import annotations

import argparse
import gc
import time

import numpy as np
import psutil

from replica.api.kv_events import KVEvent
from replica.api.tokenizer import TOKEN_DTYPE
from router.prefix_index import IndexConfig, PrefixIndex

BLOCK_SIZE = 16


def fill(index: PrefixIndex, replica: str, blocks: int, prompt_blocks: int, seed: int) -> None:
    """One replica's full cache, as the stored events of its prompts."""
    rng = np.random.default_rng(seed)
    next_hash = seed * 10**9
    for seq, start in enumerate(range(0, blocks, prompt_blocks), start=1):
        count = min(prompt_blocks, blocks - start)
        tokens = rng.integers(1, 2**31, count * BLOCK_SIZE, dtype=np.int64).astype(TOKEN_DTYPE)
        hashes = tuple(range(next_hash, next_hash + count))
        next_hash += count
        event = KVEvent(seq, "stored", hashes, None, (), "GPU", tokens.tobytes())
        index.apply_events(replica, [event])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--replicas", type=int, default=1024)
    parser.add_argument("--blocks", type=int, default=26_000)
    parser.add_argument("--prompt-blocks", type=int, default=256, help="4k-token prompts")
    args = parser.parse_args(argv)
    process = psutil.Process()
    index = PrefixIndex(IndexConfig(mode="precise"), BLOCK_SIZE, time.monotonic)
    gc.collect()
    before = process.memory_info().rss
    start = time.perf_counter()
    for i in range(args.replicas):
        name = f"replica-{i}"
        index.add_replica(name, args.blocks)
        fill(index, name, args.blocks, args.prompt_blocks, seed=i + 1)
    gc.collect()
    added = process.memory_info().rss - before
    blocks = args.replicas * args.blocks
    print(
        f"{args.replicas} replicas x {args.blocks:,} blocks ({blocks:,} cached blocks, "
        f"{index.num_entries():,} router keys) filled in {time.perf_counter() - start:.0f} s: "
        f"{added / 2**30:.2f} GiB, {added / blocks:.0f} bytes per cached block"
    )


if __name__ == "__main__":
    main()
