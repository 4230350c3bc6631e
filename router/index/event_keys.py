"""The router's own keys for the blocks a replica's KV events describe.

A ``stored`` event names its blocks by the engine's hashes (ours, or vLLM's sha256)
and carries their tokens. The router chains its own link over every block
(``replica.api.identity.next_key``), continuing from the parent block's link, and
every ``stride``-th link is a key (``replica.api.identity.prefix_keys``). It remembers,
per engine hash, the link there (one number: the chain needs nothing else to go on),
so a later event can hang off it and a ``removed`` event can name the keys to forget.
This is how llm-d indexes vLLM's events: the router depends on the engine's tokens, not
on its hash function, so a vLLM fleet with the same tokenizer is routed precisely.

A block also remembers the salt its prompt was seeded with (the root block's event
carries it; a gateway with API keys salts each tenant's prompts), so the blocks each
salt holds on the GPU are counted: a tenant's footprint in the replica's cache.

The blocks live in a packed table (``router/index/lean_index.py``): 21 bytes a slot.
"""

from __future__ import annotations

from collections import Counter

from replica.api.identity import identity_seed
from replica.api.kv_events import KVEvent, Medium
from replica.api.tokenizer import TOKEN_DTYPE
from router.index.lean_index import CPU_TIER, GPU_TIER, BlockTable

#: The tiers a block may be held in, as bits of its flags.
TIER_BITS: dict[Medium, int] = {"GPU": GPU_TIER, "CPU": CPU_TIER}


#: Held GPU blocks, over the replica's capacity, past which its events are not believed
#: (a cache never holds more than its capacity; twice is past any race of events).
OVERFULL = 2


class EventKeys:
    """One replica's blocks, by engine hash, with the router's links and their tiers.

    The chains are shared by the tiers (a link depends on tokens only), so a block
    demoted to the host hangs off a parent the GPU still holds.
    """

    def __init__(self, model: str, block_size: int, stride: int, capacity: int = 0) -> None:
        self.model = model
        self.block_size = block_size
        self.stride = stride
        self._blocks = BlockTable(capacity)
        #: The replica's GPU blocks (0: not known, as for a replica routed approximately).
        self.capacity = capacity
        #: Blocks that could not be keyed (an unknown parent, no tokens, another block size).
        self.unkeyed = 0
        #: Blocks held on the GPU, by the cache salt of their prompt, and in all.
        self.gpu_blocks_by_salt: dict[str | None, int] = {}
        self.gpu_blocks = 0
        self._salts: list[str | None] = [None]  # by number, as the table holds them
        self._salt_numbers: dict[str | None, int] = {None: 0}

    def __len__(self) -> int:
        return len(self._blocks)

    @property
    def nbytes(self) -> int:
        return self._blocks.nbytes

    def stored(self, event: KVEvent, block_size: int | None = None) -> list[int]:
        """The router's keys of the stride blocks among ``event``'s new blocks, now
        held in the event's tier."""
        step = self.block_size * TOKEN_DTYPE.itemsize
        tokens, hashes = event.token_bytes, event.block_hashes
        if (block_size or self.block_size) != self.block_size or len(tokens) != step * len(hashes):
            self.unkeyed += len(hashes)
            return []
        # seeded as the engine seeded it: by its adapter's name, else the model's
        seed = identity_seed(event.lora or self.model, event.salt)
        answer = self._blocks.stored(
            event.parent_hash,
            seed,
            self._salt_number(event.salt),
            tokens,
            hashes,
            step,
            self.stride,
            TIER_BITS[event.medium],
        )
        if answer is None:  # its parent was never seen, or already removed
            self.unkeyed += len(hashes)
            return []
        keys, gpu_added, displaced, salt = answer
        for number in displaced:
            self._count(number, -1)
        if gpu_added:
            self._count(salt, gpu_added)
        return keys

    def removed(self, event: KVEvent) -> list[int]:
        """The router's keys of the stride blocks the event's tier no longer holds."""
        keys, gpu_salts = self._blocks.removed(event.block_hashes, TIER_BITS[event.medium])
        for number, blocks in Counter(gpu_salts).items():
            self._count(number, -blocks)
        return keys

    def clear(self) -> None:
        self._blocks.clear()
        self.gpu_blocks_by_salt.clear()
        self.gpu_blocks = 0

    @property
    def overfull(self) -> bool:
        """Whether the events say the GPU holds more than ``OVERFULL`` times what it can:
        removals were lost (or never sent), and what the events say can no longer be
        told from what the replica holds."""
        return self.capacity > 0 and self.gpu_blocks > OVERFULL * self.capacity

    def _salt_number(self, salt: str | None) -> int:
        number = self._salt_numbers.get(salt)
        if number is None:
            number = self._salt_numbers[salt] = len(self._salts)
            self._salts.append(salt)
        return number

    def _count(self, number: int, blocks: int) -> None:
        self.gpu_blocks += blocks
        salt = self._salts[number]
        held = self.gpu_blocks_by_salt.get(salt, 0) + blocks
        if held:
            self.gpu_blocks_by_salt[salt] = held
        else:
            del self.gpu_blocks_by_salt[salt]
