"""The host tier: KV blocks the GPU evicted, kept in host memory to be loaded back.

When the GPU pool evicts a cached block, the engine demotes it here (a device-to-host
copy; see ``replica/api/cost_model.py`` for why it costs no step time). A prompt whose
GPU hits end where a run of host blocks begins may load that run back over PCIe
instead of recomputing it, when the cost model says loading is cheaper.

Host blocks are never pinned: a load copies their KV to freshly allocated GPU blocks,
and the host keeps its copy (as SGLang's HiCache does), so a block evicted from the
GPU again costs no second copy. Eviction is LRU over *leaves* of the host tier (no
host block hangs off them), like the GPU's, so a prefix leaves the host from its end.
Every block keeps its tokens, and a match compares them: a 64-bit collision costs a
miss here too. Identities are the GPU's, seeded per tenant, so tenants never share.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass

from replica.api.tokenizer import TOKEN_DTYPE
from replica.event_log import EventLog
from replica.prefix_cache import EvictedBlock


@dataclass(eq=False, slots=True)
class HostBlock:
    block_hash: int
    parent_hash: int | None
    token_bytes: bytes
    depth: int
    last_used: int = 0


@dataclass(slots=True)
class HostStats:
    """Counters since the last reset, in blocks."""

    stored_blocks: int = 0  # demoted from the GPU
    loaded_blocks: int = 0  # copied back to the GPU
    evictions: int = 0


class HostCache:
    """``num_blocks`` blocks of ``block_size`` tokens in host memory.

    Contract: :meth:`store` takes blocks the GPU evicted (leaves first, as it evicts
    them) and logs them as stored on the CPU; :meth:`match` finds the run of host
    blocks that continues a prompt from a given block and marks it used. The event
    log is the GPU pool's, so one sequence of events describes both tiers.
    """

    def __init__(self, num_blocks: int, block_size: int, events: EventLog) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("host num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.events = events
        self.stats = HostStats()
        self._blocks: dict[int, HostBlock] = {}
        #: parent identity -> host blocks hanging off it (the parent may be absent).
        self._children: dict[int, int] = {}
        self._candidates: list[tuple[int, int, HostBlock]] = []  # (last_used, hash, block)
        self._clock = 0

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._blocks

    # ----------------------------------------------------------------- queries

    def match(self, block_hashes: Sequence[int], token_bytes: bytes, start: int) -> int:
        """How many blocks from index ``start`` of the prompt the host holds in a row,
        with the prompt's tokens. Nothing changes (a waiting request asks every step)."""
        step = self.block_size * TOKEN_DTYPE.itemsize
        count = 0
        for index in range(start, len(block_hashes)):
            block = self._blocks.get(block_hashes[index])
            if block is None or block.token_bytes != token_bytes[index * step : (index + 1) * step]:
                break
            count += 1
        return count

    # ---------------------------------------------------------------- commands

    def store(self, evicted: Sequence[EvictedBlock]) -> int:
        """Keep blocks the GPU evicted; return how many were new here (copied)."""
        stored: list[EvictedBlock] = []
        for record in evicted:
            block = self._blocks.get(record.block_hash)
            if block is not None:
                self._touch(block)  # the host kept its copy since the last load
                continue
            if len(self._blocks) >= self.num_blocks and not self._evict_one():
                break  # every host block has a child: nothing can go
            self._add(record)
            stored.append(record)
        for chain in _chains(stored):
            hashes = tuple(r.block_hash for r in chain)
            depths = tuple(r.depth for r in chain)
            tokens = b"".join(r.token_bytes for r in chain)
            root = chain[0]
            salt, lora = (root.salt, root.lora) if root.parent_hash is None else (None, None)
            self.events.append(
                "stored", hashes, root.parent_hash, depths, "CPU", tokens, salt, lora
            )
        self.stats.stored_blocks += len(stored)
        return len(stored)

    def loaded(self, block_hashes: Sequence[int]) -> None:
        """These blocks (a run :meth:`match` found) were copied to the GPU: they were
        used now, leaves older than their parents, as on the GPU."""
        for block_hash in reversed(block_hashes):
            self._touch(self._blocks[block_hash])
        self.stats.loaded_blocks += len(block_hashes)

    def reset(self) -> None:
        """Forget every block (the GPU pool logs the one ``cleared`` for both tiers)."""
        self._blocks.clear()
        self._children.clear()
        self._candidates.clear()
        self.stats = HostStats()

    # ---------------------------------------------------------------- internals

    def _add(self, record: EvictedBlock) -> None:
        block = HostBlock(record.block_hash, record.parent_hash, record.token_bytes, record.depth)
        self._blocks[record.block_hash] = block
        if record.parent_hash is not None:
            self._children[record.parent_hash] = self._children.get(record.parent_hash, 0) + 1
        self._touch(block)

    def _touch(self, block: HostBlock) -> None:
        self._clock += 1
        block.last_used = self._clock
        if not self._children.get(block.block_hash):
            heapq.heappush(self._candidates, (block.last_used, block.block_hash, block))
        if len(self._candidates) > 2 * len(self._blocks) + 1024:
            self._prune()

    def _is_leaf(self, block: HostBlock) -> bool:
        return self._blocks.get(block.block_hash) is block and not self._children.get(
            block.block_hash
        )

    def _evict_one(self) -> bool:
        """Drop the least recently used leaf; ``False`` if there is none."""
        while self._candidates:
            stamp, _, block = heapq.heappop(self._candidates)
            if stamp != block.last_used or not self._is_leaf(block):
                continue  # stale: used since, gained a child, or already gone
            del self._blocks[block.block_hash]
            parent_hash = block.parent_hash
            if parent_hash is not None:
                remaining = self._children[parent_hash] - 1
                if remaining:
                    self._children[parent_hash] = remaining
                else:
                    del self._children[parent_hash]
                    parent = self._blocks.get(parent_hash)
                    if parent is not None:  # a new leaf, as old as it was last used
                        heapq.heappush(self._candidates, (parent.last_used, parent_hash, parent))
            self.stats.evictions += 1
            self.events.append("removed", (block.block_hash,), None, (block.depth,), medium="CPU")
            return True
        return False

    def _prune(self) -> None:
        live = [entry for entry in self._candidates if entry[0] == entry[2].last_used]
        self._candidates = [e for e in live if self._is_leaf(e[2])]
        heapq.heapify(self._candidates)

    # ---------------------------------------------------------------- checking

    def check_invariants(self) -> None:
        """Full O(n) consistency check, for tests; raises AssertionError."""
        assert len(self._blocks) <= self.num_blocks, "the host tier holds too many blocks"
        children: dict[int, int] = {}
        for block in self._blocks.values():
            if block.parent_hash is not None:
                children[block.parent_hash] = children.get(block.parent_hash, 0) + 1
        assert children == self._children, "host children counts disagree with the blocks"
        leaves = {h for h, b in self._blocks.items() if not children.get(h)}
        live = {h for stamp, h, b in self._candidates if stamp == b.last_used and self._is_leaf(b)}
        assert live == leaves, "a host leaf is missing from the candidate heap"


def _chains(records: list[EvictedBlock]) -> list[list[EvictedBlock]]:
    """Split blocks in eviction order (a leaf, then its parent, ...) into chains
    ordered root first, each hanging off its first block's parent (vLLM's
    ``BlockStored`` shape)."""
    chains: list[list[EvictedBlock]] = []
    for record in records:
        if chains and chains[-1][-1].parent_hash == record.block_hash:
            chains[-1].append(record)
        else:
            chains.append([record])
    return [chain[::-1] for chain in chains]
