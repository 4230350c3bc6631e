"""The router's own keys for the blocks a replica's KV events describe.

A ``stored`` event names its blocks by the engine's hashes (ours, or vLLM's sha256)
and carries their tokens. The router keys every ``stride``-th block boundary by its
own chained hash (``replica.api.identity.prefix_keys``), continuing the chain from
the parent block's key, and remembers, per engine hash, where the chain stood, so a
later event can hang off it and a ``removed`` event can name the keys to forget. This
is how llm-d indexes vLLM's events: the router depends on the engine's tokens, not on
its hash function, so a vLLM fleet with the same tokenizer is routed precisely.

A chain also remembers the salt its prompt was seeded with (the root block's event
carries it; a gateway with API keys salts each tenant's prompts), so the blocks each
salt holds on the GPU are counted: a tenant's footprint in the replica's cache.
"""

from __future__ import annotations

from dataclasses import dataclass

from replica.api.identity import identity_seed, next_key
from replica.api.kv_events import KVEvent, Medium
from replica.api.tokenizer import TOKEN_DTYPE

#: The tiers a block may be held in, as bits of ``_Chain.tiers``.
TIER_BITS: dict[Medium, int] = {"GPU": 1, "CPU": 2}
GPU_BIT = TIER_BITS["GPU"]


@dataclass(slots=True)
class _Chain:
    """Where the router's chain stands after one engine block."""

    key: int  # the key of the last chunk boundary at or before the block (or the seed)
    pending: bytes  # tokens since that boundary
    depth: int  # blocks from the prompt's start, this one included
    boundary: bool  # the block ends a chunk: ``key`` is its own, and is indexed
    tiers: int = 0  # which tiers hold it (TIER_BITS); forgotten when none does
    salt: str | None = None  # its prompt's cache salt (one string shared by the chain)


class EventKeys:
    """One replica's blocks, by engine hash, with the router's keys and their tiers.

    The chains are shared by the tiers (a key depends on tokens only), so a block
    demoted to the host hangs off a parent the GPU still holds.
    """

    def __init__(self, model: str, block_size: int, stride: int) -> None:
        self.model = model
        self.block_size = block_size
        self.stride = stride
        self._chains: dict[int | bytes, _Chain] = {}
        #: Blocks that could not be keyed (an unknown parent, no tokens, another block size).
        self.unkeyed = 0
        #: Blocks held on the GPU, by the cache salt of their prompt.
        self.gpu_blocks_by_salt: dict[str | None, int] = {}

    def __len__(self) -> int:
        return len(self._chains)

    def stored(self, event: KVEvent, block_size: int | None = None) -> list[int]:
        """The router's keys of the chunk boundaries among ``event``'s new blocks, now
        held in the event's tier."""
        step = self.block_size * TOKEN_DTYPE.itemsize
        tokens = event.token_bytes
        if (block_size or self.block_size) != self.block_size or len(tokens) != step * len(
            event.block_hashes
        ):
            self.unkeyed += len(event.block_hashes)
            return []
        if event.parent_hash is None:
            # seeded as the engine seeded it: by its adapter's name, else the model's
            seed = identity_seed(event.lora or self.model, event.salt)
            chain = _Chain(seed, b"", 0, False, salt=event.salt)
        else:
            parent = self._chains.get(event.parent_hash)
            if parent is None:  # its parent was never seen, or already removed
                self.unkeyed += len(event.block_hashes)
                return []
            chain = parent
        key, carried, depth, keys = chain.key, chain.pending, chain.depth, []
        tier, chains, stride, start = TIER_BITS[event.medium], self._chains, self.stride, 0
        salt, new_on_gpu = chain.salt, 0
        for index, block_hash in enumerate(event.block_hashes):
            # tokens[start:end] are this event's tokens since the last boundary; before
            # the event's first boundary, ``carried`` (the parent's pending) leads them.
            end = (index + 1) * step
            depth += 1
            boundary = depth % stride == 0
            pending = carried + tokens[start:end] if carried else tokens[start:end]
            if boundary:
                key = next_key(key, pending, first=depth == stride)
                keys.append(key)
                carried, start, pending = b"", end, b""
            held = chains.get(block_hash)
            tiers = held.tiers if held else 0
            new_on_gpu += tier & ~tiers & GPU_BIT
            if held is not None and held.key == key and held.depth == depth:
                held.tiers |= tier  # the same block, now in another tier as well
            else:
                if tiers & GPU_BIT:  # a block the GPU held under another chain
                    self._count(held.salt, -1)  # type: ignore[union-attr]
                    new_on_gpu += GPU_BIT
                chains[block_hash] = _Chain(key, pending, depth, boundary, tier | tiers, salt)
        if new_on_gpu:
            self._count(salt, new_on_gpu // GPU_BIT)
        return keys

    def _count(self, salt: str | None, blocks: int) -> None:
        held = self.gpu_blocks_by_salt.get(salt, 0) + blocks
        if held:
            self.gpu_blocks_by_salt[salt] = held
        else:
            del self.gpu_blocks_by_salt[salt]

    def removed(self, event: KVEvent) -> list[int]:
        """The router's keys of the chunk boundaries among the blocks the event's tier
        no longer holds."""
        keys, tier, chains = [], TIER_BITS[event.medium], self._chains
        for block_hash in event.block_hashes:
            chain = chains.get(block_hash)
            if chain is None or not chain.tiers & tier:
                continue
            chain.tiers &= ~tier
            if tier == GPU_BIT:
                self._count(chain.salt, -1)
            if not chain.tiers:
                del chains[block_hash]
            if chain.boundary:
                keys.append(chain.key)
        return keys

    def clear(self) -> None:
        self._chains.clear()
        self.gpu_blocks_by_salt.clear()
