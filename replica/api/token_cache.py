"""The tokens of a conversation's earlier messages, kept, so that a chat turn's
tokenization costs what is new in it.

A Hugging Face tokenizer first cuts its input at its added tokens (a chat template's
``<|start_header_id|>``, ``<|eot_id|>`` ...), then encodes each piece between them on
its own: normalized, pre-tokenized and split by the model with no look at its
neighbours. So a rendered conversation's ids are its pieces' ids joined, each added
token's id between them, and a piece an earlier turn sent (the system prompt, every
earlier message) need not be encoded again. :class:`PieceCache` cuts the text as the
tokenizer does (at the leftmost added token, the longest where several start there)
and keeps each piece's ids by its text and scope, the least recently used dropped
first, within a bound in tokens.

The scope is whose conversations a piece came from (the gateway gives the tenant's
name): a piece is found only by the scope that sent it, so that how long a tenant's
text takes to tokenize says nothing of what another tenant sent (a long system prompt
already cached answers in a fraction of the time it takes to encode).

That is exact only where the tokenizer cuts so: no added token that strips the spaces
beside it, must stand as a whole word or is matched after normalizing, and no
pre-tokenizer that treats the input's first piece apart from the others (Metaspace's
``prepend_scheme: first``, as in Gemma's and Llama 2's newer files).
:meth:`PieceCache.for_tokenizer` gives none for such a tokenizer, and none for one
that does not encode a sample conversation the same both ways.
"""

from __future__ import annotations

import json
import re
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import numpy as np
from tokenizers import Tokenizer as RustTokenizer

from replica.api.tokenizer import TOKEN_DTYPE

#: The default bound: 4 million tokens, about 16 MB of ids and as much text.
DEFAULT_CACHE_TOKENS = 4_000_000


@dataclass(frozen=True)
class TokenCacheStats:
    """What the cache holds (its bytes: the pieces' text and ids) and how it served."""

    pieces: int
    tokens: int
    bytes: int
    max_tokens: int
    #: Pieces found in the cache and their tokens; pieces encoded and theirs.
    hits: int
    hit_tokens: int
    misses: int
    encoded_tokens: int


class PieceCache:
    """Each piece's ids between a tokenizer's added tokens, by the piece's text."""

    def __init__(self, tokenizer: RustTokenizer, max_tokens: int = DEFAULT_CACHE_TOKENS) -> None:
        added = tokenizer.get_added_tokens_decoder()
        self._tokenizer, self.max_tokens = tokenizer, max_tokens
        self._added = {t.content: np.array([i], dtype=TOKEN_DTYPE) for i, t in added.items()}
        longest_first = sorted(self._added, key=len, reverse=True)
        self._cut = re.compile("|".join(re.escape(token) for token in longest_first))
        self._pieces: OrderedDict[tuple[str | None, str], np.ndarray] = OrderedDict()
        self.clear()

    @classmethod
    def for_tokenizer(
        cls, tokenizer: RustTokenizer, max_tokens: int = DEFAULT_CACHE_TOKENS
    ) -> PieceCache | None:
        """A cache for ``tokenizer``, or ``None`` where cutting at its added tokens could
        change its ids (see the module's docstring) or caching is off (``max_tokens``
        0)."""
        if max_tokens <= 0 or not _cuts_at_added_tokens(tokenizer):
            return None
        cache = cls(tokenizer, max_tokens)
        sample = " ".join(f"{token} a  b{token}c\n {token}" for token in cache._added) + " end"
        whole = tokenizer.encode(sample, add_special_tokens=False).ids
        if cache.encode(sample).tolist() != whole:
            return None
        cache.clear()
        return cache

    def encode(self, text: str, scope: str | None = None) -> np.ndarray:
        """``text``'s ids without the tokenizer's own special tokens (no BOS added): the
        same as ``tokenizer.encode(text, add_special_tokens=False)``; the pieces that
        ``scope`` sent before are not encoded again."""
        parts, start = [], 0
        for match in self._cut.finditer(text):
            if match.start() > start:
                parts.append(self._piece(scope, text[start : match.start()]))
            parts.append(self._added[match.group()])
            start = match.end()
        if start < len(text):
            parts.append(self._piece(scope, text[start:]))
        return np.concatenate(parts) if parts else np.empty(0, dtype=TOKEN_DTYPE)

    def stats(self) -> TokenCacheStats:
        return TokenCacheStats(
            pieces=len(self._pieces),
            tokens=self._tokens,
            bytes=self._text + self._tokens * np.dtype(TOKEN_DTYPE).itemsize,
            max_tokens=self.max_tokens,
            hits=self._hits,
            hit_tokens=self._hit_tokens,
            misses=self._misses,
            encoded_tokens=self._encoded_tokens,
        )

    def clear(self) -> None:
        self._pieces.clear()
        self._tokens = self._text = 0
        self._hits = self._hit_tokens = self._misses = self._encoded_tokens = 0

    def _piece(self, scope: str | None, piece: str) -> np.ndarray:
        key = (scope, piece)
        ids = self._pieces.get(key)
        if ids is not None:
            self._pieces.move_to_end(key)
            self._hits += 1
            self._hit_tokens += len(ids)
            return ids
        ids = np.asarray(
            self._tokenizer.encode(piece, add_special_tokens=False).ids, dtype=TOKEN_DTYPE
        )
        self._misses += 1
        self._encoded_tokens += len(ids)
        if len(ids) <= self.max_tokens:
            self._keep(key, ids)
        return ids

    def _keep(self, key: tuple[str | None, str], ids: np.ndarray) -> None:
        self._pieces[key] = ids
        self._tokens += len(ids)
        self._text += len(key[1])
        while self._tokens > self.max_tokens:
            (_, dropped), dropped_ids = self._pieces.popitem(last=False)
            self._tokens -= len(dropped_ids)
            self._text -= len(dropped)


def _cuts_at_added_tokens(tokenizer: RustTokenizer) -> bool:
    """Whether ``tokenizer`` encodes the pieces between its added tokens independently."""
    added = tokenizer.get_added_tokens_decoder().values()
    if not added:
        return False  # nothing to cut at: a piece would be the whole text
    normalizes = tokenizer.normalizer is not None
    if any(t.lstrip or t.rstrip or t.single_word or (t.normalized and normalizes) for t in added):
        return False
    config = json.loads(tokenizer.to_str())
    return not _prepends_first(config.get("pre_tokenizer")) and not _prepends_first(
        config.get("normalizer")
    )


def _prepends_first(part: Any) -> bool:
    """A Metaspace anywhere in ``part`` (a pre-tokenizer or a sequence of them) that
    prepends its space to the input's first piece only."""
    if isinstance(part, dict):
        if part.get("type") == "Metaspace" and part.get("prepend_scheme") == "first":
            return True
        return any(_prepends_first(value) for value in part.values())
    if isinstance(part, list):
        return any(_prepends_first(value) for value in part)
    return False
