"""Which prompt beginnings the gateway sees most: counted by their leading identity.

A prompt's first stride identity (its first ``stride`` blocks, hashed with the
tenant's salt) names the prefix it starts with: an application's system prompt, a
conversation's first turn. Counting requests per leading identity on the request
path costs one dict update; the dashboard reads the most-counted ones on demand.

Bounded: every ``half_life`` requests each count halves and those reaching zero are
dropped, then only the ``kept`` largest survive, so the table holds at most
``kept + half_life`` prefixes. Each keeps a reference to the identities of the latest
prompt through it (no copy: the request made them) to ask the index who holds how
much of it, and the first ``sample_tokens`` token ids of the first prompt through it,
which only an administrator may have decoded (``router/http/dashboard``).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass
class HotPrefix:
    leading: int
    #: Requests through it recently (halved every ``half_life`` requests).
    requests: int
    stride_hashes: Sequence[int]
    tokens: np.ndarray
    #: The model whose tokens they are (its tokenizer decodes them).
    model: str | None = None


class HotPrefixes:
    def __init__(self, kept: int = 1024, half_life: int = 4096, sample_tokens: int = 256) -> None:
        self._kept, self._half_life, self._sample_tokens = kept, half_life, sample_tokens
        self._prefixes: dict[int, HotPrefix] = {}
        self._seen = 0

    def record(
        self, stride_hashes: Sequence[int], prompt: np.ndarray, model: str | None = None
    ) -> None:
        """One request whose prompt, for ``model``, has these identities (none: shorter
        than a stride)."""
        if not stride_hashes:
            return
        prefix = self._prefixes.get(stride_hashes[0])
        if prefix is None:  # the only copy, once per new prefix: its first tokens
            sample = prompt[: self._sample_tokens].copy()
            hot = HotPrefix(stride_hashes[0], 1, stride_hashes, sample, model)
            self._prefixes[stride_hashes[0]] = hot
        else:
            prefix.requests += 1
            prefix.stride_hashes = stride_hashes
        self._seen += 1
        if self._seen % self._half_life == 0:
            self._decay()

    def _decay(self) -> None:
        for prefix in self._prefixes.values():
            prefix.requests //= 2
        alive = [p for p in self._prefixes.values() if p.requests]
        if len(alive) > self._kept:
            alive = heapq.nlargest(self._kept, alive, key=lambda p: p.requests)
        self._prefixes = {p.leading: p for p in alive}

    def top(self, count: int) -> list[HotPrefix]:
        """The ``count`` most requested, most first (a scan of the bounded table)."""
        return heapq.nlargest(count, self._prefixes.values(), key=lambda p: p.requests)

    def __len__(self) -> int:
        return len(self._prefixes)
