"""Block identity: one function, used by the router and the replica alike.

A block's identity is ``xxh3_64`` over the bytes of every token from the start of
the prompt to the end of that block, computed with one streaming state (``update``
per block, ``intdigest`` at each block end). Position is baked in, like a chained
hash, and the result is chunk-invariant: the identity at token 64 is the same
whether it was computed in blocks of 16 or of 64, so a router may look at every
k-th boundary and get the replica's numbers. The state's seed comes from the model
name (or, for a request served under a LoRA adapter, the adapter's: vLLM salts its
block hashes with the adapter's name likewise) and the tenant's cache salt, so two
tenants, or two adapters, never share an identity.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np
import xxhash

from replica.api.tokenizer import TOKEN_DTYPE

try:  # prefix_keys and next_key in C, where a compiler built them (pyproject.toml)
    from replica.api import _prefix_keys as _compiled
except ImportError:  # pragma: no cover - the same keys, from the Python below
    _compiled = None  # type: ignore[assignment]

#: The model our simulated replicas serve; its name seeds every block identity.
DEFAULT_MODEL = "sim-llama3-8b"
#: Tokens per KV block, as vLLM's default; only full blocks have an identity.
DEFAULT_BLOCK_SIZE = 16


@lru_cache(maxsize=4096)
def identity_seed(model: str, cache_salt: str | None = None) -> int:
    """The seed of every identity for one (model or adapter name, tenant salt) pair."""
    return xxhash.xxh3_64_intdigest(f"{model}\x00{cache_salt or ''}".encode())


class BlockHasher:
    """Streaming identities of a growing token sequence, one per full block.

    ``extend`` may be called with any number of tokens; it returns the identities
    of the blocks that became full. A trailing partial block has no identity yet.
    """

    __slots__ = ("_pending", "_state", "_step", "block_size")

    def __init__(self, block_size: int, seed: int) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.block_size = block_size
        self._step = block_size * TOKEN_DTYPE.itemsize
        self._state = xxhash.xxh3_64(seed=seed)
        self._pending = b""

    def extend(self, tokens: np.ndarray) -> list[int]:
        return self.extend_bytes(np.ascontiguousarray(tokens, dtype=TOKEN_DTYPE).tobytes())

    def hold(self, data: bytes) -> None:
        """Take tokens known not to complete a block (a cheap path for decoding)."""
        self._pending += data

    def extend_bytes(self, data: bytes) -> list[int]:
        """Like :meth:`extend`, for tokens already laid out as little-endian uint32 bytes."""
        data = self._pending + data if self._pending else data
        step, state, hashes = self._step, self._state, []
        full = len(data) - len(data) % step
        for start in range(0, full, step):
            state.update(data[start : start + step])
            hashes.append(state.intdigest())
        self._pending = data[full:]
        return hashes


def block_hashes(tokens: np.ndarray, block_size: int, seed: int) -> list[int]:
    """Identities of the full blocks of ``tokens`` (stride ``block_size``)."""
    return BlockHasher(block_size, seed).extend(tokens)


def prefix_keys(tokens: np.ndarray, block_size: int, stride: int, seed: int) -> list[int]:
    """The router's keys of a prompt: a chain over its full blocks, each link
    (:func:`next_key`) hashing one block's tokens with the link before as the seed, and
    one key per ``stride`` blocks, the link at that block.

    A chain can be continued from any block's link with the next blocks' tokens alone,
    which is what lets a router key the blocks a ``BlockStored`` event carries (parent
    hash, token ids) without the prompt's earlier tokens, as llm-d keys vLLM's events;
    and since every block has its link, the router keeps one number per engine block
    (``router/index/event_keys.py``), not the tokens since the last key.
    """
    data = np.ascontiguousarray(tokens, dtype=TOKEN_DTYPE).data
    step = block_size * TOKEN_DTYPE.itemsize
    if _compiled is not None:
        return _compiled.prefix_keys(data, step, stride, seed)
    return python_prefix_keys(data.tobytes(), step, stride, seed)


def prefix_keys_after(
    tokens: np.ndarray,
    block_size: int,
    stride: int,
    seed: int,
    old_tokens: np.ndarray,
    old_keys: list[int],
) -> tuple[list[int], int]:
    """:func:`prefix_keys` of ``tokens``, given an earlier prompt's tokens and keys (the
    same seed and sizes), and how many of those it kept: the strides both hold token for
    token keep the earlier keys, and the chain goes on from the last of them. Exact: the
    same keys as hashing the whole; what is hashed is what is new (the rest is compared,
    a ``memcmp``)."""
    data = np.ascontiguousarray(tokens, dtype=TOKEN_DTYPE).data
    old = np.ascontiguousarray(old_tokens, dtype=TOKEN_DTYPE).data
    step = block_size * TOKEN_DTYPE.itemsize
    if _compiled is not None:
        return _compiled.prefix_keys_after(data, step, stride, seed, old, old_keys)
    chunk = step * stride
    new, before = data.tobytes(), old.tobytes()
    low, high = 0, min(len(new) // chunk, len(before) // chunk, len(old_keys))
    while low < high:  # the most leading strides that agree, by bisection
        middle = (low + high + 1) // 2
        if new[: middle * chunk] == before[: middle * chunk]:
            low = middle
        else:
            high = middle - 1
    key = old_keys[low - 1] if low else seed
    return old_keys[:low] + python_prefix_keys(new[low * chunk :], step, stride, key), low


def affinity_key(tokens: np.ndarray, block_size: int, stride: int, seed: int) -> int | None:
    """The identity of a prompt's first ``stride`` blocks, as the replica computes it
    (``None`` if shorter): what rendezvous hashing spreads cold prompts by. It does not
    depend on how the router chains its keys, so a change there moves no prompt."""
    size = block_size * stride
    if len(tokens) < size:
        return None
    head = np.ascontiguousarray(tokens[:size], dtype=TOKEN_DTYPE).tobytes()
    return xxhash.xxh3_64_intdigest(head, seed=seed)


#: Blocks up to this many bytes are hashed seeded by the link before; longer ones are
#: hashed unseeded first (see :func:`next_key`).
SHORT_BLOCK_BYTES = 240


def next_key(key: int, block: bytes) -> int:
    """The chain's link after ``key`` (the seed, for the first block) over one block's
    token bytes.

    ``xxh3_64(block, seed=key)``; a block longer than 240 bytes seeds a hash of its own
    unseeded digest instead: xxh3 seeded over more than 240 bytes derives a secret from
    the seed on every call, six times the cost of hashing the block, while seeded over
    8 bytes it costs nothing more.
    """
    if _compiled is not None:
        return _compiled.next_key(key, block)
    return python_next_key(key, block)


def python_next_key(key: int, block: bytes) -> int:
    """:func:`next_key` in Python alone (what the compiled one must equal)."""
    if len(block) <= SHORT_BLOCK_BYTES:
        return xxhash.xxh3_64_intdigest(block, seed=key)
    link = xxhash.xxh3_64_intdigest(block).to_bytes(8, "little")
    return xxhash.xxh3_64_intdigest(link, seed=key)


def python_prefix_keys(data: bytes, step: int, stride: int, seed: int) -> list[int]:
    """:func:`prefix_keys` over token bytes, ``step`` bytes a block, in Python alone."""
    keys: list[int] = []
    key = seed
    for block, start in enumerate(range(0, len(data) - len(data) % step, step), start=1):
        key = python_next_key(key, data[start : start + step])
        if block % stride == 0:
            keys.append(key)
    return keys
