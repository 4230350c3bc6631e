"""The router's keys of recent long prompts, so that a conversation's next turn hashes
only what is new.

A chat resends its whole history every turn: the gateway would hash a 240k-token
prompt again for a few new tokens. The keys chain block by block
(``replica.api.identity.prefix_keys``), so a prompt that starts with an earlier one
keeps that one's keys and goes on from its last common stride
(``prefix_keys_after``): exact, the same keys as hashing the whole, after one
``memcmp`` of the common part (about a tenth of the cost of hashing it).

The earlier prompt is found by the first ``HEAD_TOKENS`` tokens of the new one (and
its seed): a conversation's turns share their head once it is that long, and so do
prompts that open with the same long document; shorter prompts are hashed whole (a few
microseconds). Each head keeps its latest prompt; the whole is an LRU bounded in
tokens (``GatewayConfig.key_cache_tokens``; its figures in ``/stats``: ``key_cache``).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import xxhash

from replica.api.identity import prefix_keys, prefix_keys_after
from replica.api.tokenizer import TOKEN_DTYPE

#: Tokens that name a prompt's conversation: shorter prompts are not cached.
HEAD_TOKENS = 4096
#: The default bound: 4M tokens, 16 MB of token ids (and about 2.5 MB of keys).
DEFAULT_KEY_CACHE_TOKENS = 4 * 2**20


@dataclass(frozen=True)
class KeyCacheStats:
    """What the cache holds and how it served: prompts found by their head (hits) and
    the keys they kept, prompts hashed whole (misses)."""

    prompts: int
    tokens: int
    max_tokens: int
    hits: int
    kept_keys: int
    misses: int
    hashed_keys: int


class PrefixKeyCache:
    """Recent long prompts' tokens and keys, by their head (see the module docstring)."""

    def __init__(self, block_size: int, stride: int, max_tokens: int = DEFAULT_KEY_CACHE_TOKENS):
        if max_tokens < 0:
            raise ValueError(f"the key cache's size must not be negative, got {max_tokens}")
        self.block_size, self.stride, self.max_tokens = block_size, stride, max_tokens
        self._prompts: OrderedDict[int, tuple[np.ndarray, list[int]]] = OrderedDict()
        self._tokens = 0
        self._hits = self._kept = self._misses = self._hashed = 0

    def keys(self, prompt: np.ndarray, seed: int) -> list[int]:
        """The router's keys of ``prompt`` (as ``prefix_keys``), seeded by ``seed``."""
        tokens = np.ascontiguousarray(prompt, dtype=TOKEN_DTYPE)
        if len(tokens) < HEAD_TOKENS or len(tokens) > self.max_tokens:
            return prefix_keys(tokens, self.block_size, self.stride, seed)
        head = xxhash.xxh3_64_intdigest(tokens[:HEAD_TOKENS].data, seed=seed)
        earlier = self._prompts.pop(head, None)
        if earlier is None:
            keys = prefix_keys(tokens, self.block_size, self.stride, seed)
            self._misses += 1
            self._hashed += len(keys)
        else:
            old_tokens, old_keys = earlier
            self._tokens -= len(old_tokens)
            keys, kept = prefix_keys_after(
                tokens, self.block_size, self.stride, seed, old_tokens, old_keys
            )
            self._hits += 1
            self._kept += kept
            self._hashed += len(keys) - kept
        self._prompts[head] = (tokens, keys)
        self._tokens += len(tokens)
        while self._tokens > self.max_tokens:
            old_tokens, _ = self._prompts.popitem(last=False)[1]
            self._tokens -= len(old_tokens)
        return keys

    def stats(self) -> KeyCacheStats:
        return KeyCacheStats(
            len(self._prompts),
            self._tokens,
            self.max_tokens,
            self._hits,
            self._kept,
            self._misses,
            self._hashed,
        )

    def clear(self) -> None:
        self._prompts.clear()
        self._tokens = self._hits = self._kept = self._misses = self._hashed = 0
