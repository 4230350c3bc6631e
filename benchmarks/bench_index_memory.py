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
from router.index.prefix_index import IndexConfig, PrefixIndex

BLOCK_SIZE = 16


def events(blocks: int, prompt_blocks: int, event_blocks: int, seed: int) -> list[KVEvent]:
    """One replica's full cache, as the stored events of its prompts, each prompt in
    events of ``event_blocks`` blocks (an engine stores a prompt's blocks as its prefill
    computes them, and a decode's one at a time), each after the one before."""
    rng = np.random.default_rng(seed)
    next_hash, made = seed * 10**9, []
    for start in range(0, blocks, prompt_blocks):
        count = min(prompt_blocks, blocks - start)
        tokens = rng.integers(1, 2**31, count * BLOCK_SIZE, dtype=np.int64).astype(TOKEN_DTYPE)
        data, parent = tokens.tobytes(), None
        for first in range(0, count, event_blocks):
            last = min(first + event_blocks, count)
            hashes = tuple(range(next_hash + first, next_hash + last))
            step = BLOCK_SIZE * TOKEN_DTYPE.itemsize
            chunk = data[first * step : last * step]
            made.append(KVEvent(len(made) + 1, "stored", hashes, parent, (), "GPU", chunk))
            parent = hashes[-1]
        next_hash += count
    return made


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--replicas", type=int, default=1024)
    parser.add_argument("--blocks", type=int, default=26_000)
    parser.add_argument("--prompt-blocks", type=int, default=256, help="4k-token prompts")
    parser.add_argument(
        "--event-blocks", type=int, default=0, help="blocks per stored event (0: a prompt's)"
    )
    args = parser.parse_args(argv)
    event_blocks = args.event_blocks or args.prompt_blocks
    process = psutil.Process()
    index = PrefixIndex(IndexConfig(mode="precise"), BLOCK_SIZE, time.monotonic)
    gc.collect()
    before = process.memory_info().rss
    applying = 0.0
    for i in range(args.replicas):
        name = f"replica-{i}"
        index.add_replica(name, args.blocks)
        made = events(args.blocks, args.prompt_blocks, event_blocks, seed=i + 1)
        start = time.perf_counter()
        index.apply_events(name, made)
        applying += time.perf_counter() - start
        del made
    gc.collect()
    added = process.memory_info().rss - before
    blocks = args.replicas * args.blocks
    print(
        f"{args.replicas} replicas x {args.blocks:,} blocks ({blocks:,} cached blocks, "
        f"{index.num_entries():,} router keys, events of {event_blocks} blocks): "
        f"{added / 2**30:.2f} GiB, {added / blocks:.0f} bytes per cached block; "
        f"events applied in {applying:.1f} s, {blocks / applying / 1e6:.2f} M blocks/s"
    )


if __name__ == "__main__":
    main()
