"""The precise index's two big tables, packed: what a replica's events say it holds.

At a thousand replicas of 26,000 cached blocks each, Python objects per block cost
hundreds of bytes (a dict slot, an int, a small object and the tokens since the last
key: 376 bytes a block before these tables). So the precise index keeps:

- per replica, a :class:`BlockTable`: engine block hash -> the router's chain link at
  that block (``replica.api.identity.next_key``: one number, since the chain has a link
  per block), the number of its prompt's cache salt, its phase (blocks since the last
  stride key) and the tiers holding it: 21 bytes a slot;
- per index, a :class:`KeySets`: stride key -> the replicas holding it, as an
  interned bitmask (a prefix held by the same replicas shares one Python int): 12 bytes
  a slot.

Both are C tables (``router/index/_lean_index.c``) where a compiler built them; the classes
below are their Python twins, the reference they must equal operation by operation
(tests/router/test_lean_index.py), and what runs where no compiler did: the same
answers, in the memory of Python's dicts.
"""

from __future__ import annotations

from collections.abc import Sequence

import xxhash

from replica.api.identity import next_key

#: Tiers, as bits of a block's flags (beside its phase).
GPU_TIER, CPU_TIER = 1, 2
_TIERS = GPU_TIER | CPU_TIER
#: A phase fits in the six bits above the tiers'.
MAX_STRIDE = 63
_MASK64 = (1 << 64) - 1

BlockHash = int | bytes
#: ``stored``'s answer: the keys of the stride blocks stored, how many blocks the GPU
#: now holds that it did not, the salt numbers of GPU blocks it held under another
#: chain (overwritten: each counts one block fewer), and the chain's salt number.
Stored = tuple[list[int], int, list[int], int]


def engine_hash(block_hash: BlockHash) -> int:
    """An engine's block hash as 64 bits, as the C tables read it: an int's low 64
    bits (ours and vLLM's fit), the xxh3 of a bytes hash (vLLM's sha256)."""
    if isinstance(block_hash, int):
        return block_hash & _MASK64
    if isinstance(block_hash, bytes):
        return xxhash.xxh3_64_intdigest(block_hash)
    raise TypeError(f"a block hash is an int or bytes, not {type(block_hash).__name__}")


class PyBlockTable:
    """Engine block hash -> (chain link, salt number, phase << 2 | tiers)."""

    def __init__(self, capacity: int = 0) -> None:
        self._blocks: dict[int, tuple[int, int, int]] = {}

    def __len__(self) -> int:
        return len(self._blocks)

    @property
    def nbytes(self) -> int:
        return len(self._blocks) * 200  # about: a dict slot, an int key, a tuple of three

    def stored(
        self,
        parent: BlockHash | None,
        seed: int,
        salt: int,
        data: bytes,
        hashes: Sequence[BlockHash],
        step: int,
        stride: int,
        tier: int,
    ) -> Stored | None:
        """Chain the event's blocks from ``parent``'s link (``None``: from ``seed``,
        under ``salt``), or ``None`` if ``parent`` is unknown."""
        if (
            not 1 <= stride <= MAX_STRIDE
            or step < 1
            or len(data) != step * len(hashes)
            or not 1 <= tier <= _TIERS
        ):
            raise ValueError("stored: bad stride, tier or token bytes")
        link, phase, blocks = seed, 0, self._blocks
        if parent is not None:
            held = blocks.get(engine_hash(parent))
            if held is None:
                return None
            link, salt, flags = held
            phase = flags >> 2
        keys: list[int] = []
        displaced: list[int] = []
        gpu_added = 0
        for index, block_hash in enumerate(hashes):
            block = engine_hash(block_hash)
            link = next_key(link, data[index * step : (index + 1) * step])
            phase = (phase + 1) % stride
            if phase == 0:
                keys.append(link)
            old = blocks.get(block)
            tiers = old[2] & _TIERS if old else 0
            if tier & ~tiers & GPU_TIER:
                gpu_added += 1
            if old is not None and old[0] == link and old[2] >> 2 == phase:
                blocks[block] = (link, old[1], old[2] | tier)  # now in another tier too
                continue
            if tiers & GPU_TIER:  # a block the GPU held under another chain
                displaced.append(old[1])  # type: ignore[index]
                gpu_added += 1
            blocks[block] = (link, salt, phase << 2 | tier | tiers)
        return keys, gpu_added, displaced, salt

    def removed(self, hashes: Sequence[BlockHash], tier: int) -> tuple[list[int], list[int]]:
        """The keys of the stride blocks ``tier`` let go, and the salt numbers of the
        GPU blocks let go."""
        keys: list[int] = []
        gpu_salts: list[int] = []
        blocks = self._blocks
        for block_hash in hashes:
            block = engine_hash(block_hash)
            held = blocks.get(block)
            if held is None or not held[2] & tier:
                continue
            link, salt, flags = held
            flags &= ~tier
            if tier == GPU_TIER:
                gpu_salts.append(salt)
            if flags & _TIERS:
                blocks[block] = (link, salt, flags)
            else:
                del blocks[block]
            if flags >> 2 == 0:
                keys.append(link)
        return keys, gpu_salts

    def clear(self) -> None:
        self._blocks.clear()


class PyKeySets:
    """Stride key -> bitmask of the replicas holding it, with a count per replica."""

    def __init__(self) -> None:
        self._holders: dict[int, int] = {}
        self._sizes: dict[int, int] = {}

    def __len__(self) -> int:
        return len(self._holders)

    @property
    def nbytes(self) -> int:
        return len(self._holders) * 100  # about: a dict slot, an int key, its mask

    @property
    def masks(self) -> int:
        return len(set(self._holders.values()))

    def get(self, key: int, default: int) -> int:
        return self._holders.get(key & _MASK64, default)

    def size(self, bit: int) -> int:
        return self._sizes.get(bit, 0)

    def held(self, bit: int) -> list[int]:
        """The keys replica ``bit`` holds (for tests and inspection: a whole pass)."""
        return [key for key, mask in self._holders.items() if mask >> bit & 1]

    def add(self, bit: int, keys: Sequence[int]) -> None:
        holders, mask, added = self._holders, 1 << bit, 0
        for key in keys:
            key &= _MASK64
            held = holders.get(key, 0)
            if not held & mask:
                holders[key] = held | mask
                added += 1
        self._sizes[bit] = self._sizes.get(bit, 0) + added

    def discard(self, bit: int, keys: Sequence[int]) -> None:
        holders, mask, removed = self._holders, 1 << bit, 0
        for key in keys:
            key &= _MASK64
            held = holders.get(key, 0)
            if held & mask:
                removed += 1
                if held == mask:
                    del holders[key]
                else:
                    holders[key] = held & ~mask
        self._sizes[bit] = self._sizes.get(bit, 0) - removed

    def clear(self, bit: int) -> None:
        mask = 1 << bit
        for key, held in list(self._holders.items()):
            if held & mask:
                if held == mask:
                    del self._holders[key]
                else:
                    self._holders[key] = held & ~mask
        self._sizes[bit] = 0


try:  # the packed tables, where a compiler built them (pyproject.toml)
    from router.index._lean_index import BlockTable, KeySets
except ImportError:  # pragma: no cover - the same answers, from the twins above
    BlockTable, KeySets = PyBlockTable, PyKeySets  # type: ignore[misc, assignment]
