"""The toy model's sampling under a request's ``logit_bias``.

The simulated model's logits are all equal, so adding a bias is exact: each biased
token weighs ``e**bias`` against 1 for every other token of the vocabulary, and +100
all but forces a token while -100 all but bans it, as with a real model. The end of
sequence is drawn apart from the vocabulary (``eos_probability``), its logit never
biased here, so a bias scales its chance as it scales every unbiased token's
(:func:`unbiased_share`): +100 on one token holds EOS back too, as in vLLM."""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence

#: vLLM clamps a bias to OpenAI's range.
MAX_BIAS = 100.0


def biased_token(
    draw: int,
    vocabulary: Sequence[int],
    known: Collection[int],
    bias: tuple[tuple[int, float], ...],
) -> int:
    """The token a 64-bit ``draw`` picks; ``known`` holds ``vocabulary``'s ids (a set)."""
    weights = {token: math.exp(max(-MAX_BIAS, min(MAX_BIAS, b))) for token, b in bias}
    others = len(vocabulary) - sum(1 for token in weights if token in known)
    x = (draw & ((1 << 53) - 1)) / (1 << 53) * (sum(weights.values()) + others)
    for token, weight in weights.items():
        if x < weight:
            return token
        x -= weight
    if others == 0:  # the last biased token, where rounding left x past them all
        return token
    index = draw % len(vocabulary)
    while vocabulary[index] in weights:  # an unbiased token, uniformly
        index = (index + 1) % len(vocabulary)
    return vocabulary[index]


def unbiased_share(
    vocabulary_size: int, known: Collection[int], bias: tuple[tuple[int, float], ...]
) -> float:
    """What a token the bias leaves alone keeps of its unbiased chance (1: no bias)."""
    weights = {token: math.exp(max(-MAX_BIAS, min(MAX_BIAS, b))) for token, b in bias}
    others = vocabulary_size - sum(1 for token in weights if token in known)
    return vocabulary_size / (sum(weights.values()) + others)
