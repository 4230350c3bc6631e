"""The gateway's cache of recent long prompts' keys: a conversation's next turn keeps the
keys of the turn before and hashes only what is new, exactly; the cache stays within
its bound."""

import numpy as np

from replica.api.identity import identity_seed, prefix_keys
from router.index.key_cache import HEAD_TOKENS, PrefixKeyCache
from tests.shared import prompt

BLOCK, STRIDE = 16, 4
SEED = identity_seed("model")


def test_a_conversations_next_turn_keeps_the_keys_of_the_last():
    cache = PrefixKeyCache(BLOCK, STRIDE)
    turn = prompt(HEAD_TOKENS + 3000)
    first = cache.keys(turn, SEED)
    for more in range(1, 4):  # each turn: the history, the reply, a new question
        turn = np.concatenate([turn, prompt(500, 10**6 * more)])
        keys = cache.keys(turn, SEED)
        assert keys == prefix_keys(turn, BLOCK, STRIDE, SEED)  # exact
        assert keys[: len(first)] == first
    stats = cache.stats()
    assert (stats.prompts, stats.hits, stats.misses) == (1, 3, 1)
    assert stats.tokens == len(turn) and stats.kept_keys >= 3 * len(first)
    # hashed: the first turn whole, then about 500 new tokens a turn
    assert stats.hashed_keys <= len(first) + 3 * (500 // (BLOCK * STRIDE) + 1)


def test_a_turn_that_edits_its_history_is_keyed_from_where_it_differs():
    cache = PrefixKeyCache(BLOCK, STRIDE)
    turn = prompt(HEAD_TOKENS + 2000)
    cache.keys(turn, SEED)
    edited = turn.copy()
    edited[HEAD_TOKENS + 1000] += 1  # a message rewritten in the middle
    assert cache.keys(edited, SEED) == prefix_keys(edited, BLOCK, STRIDE, SEED)
    assert cache.stats().hits == 1
    # Another seed (tenant, model or adapter) never shares an entry.
    other = identity_seed("model", "tenant")
    assert cache.keys(edited, other) == prefix_keys(edited, BLOCK, STRIDE, other)
    assert cache.stats().misses == 2


def test_short_prompts_are_hashed_whole_and_the_cache_keeps_its_bound():
    cache = PrefixKeyCache(BLOCK, STRIDE, max_tokens=3 * HEAD_TOKENS)
    short = prompt(HEAD_TOKENS - 1)
    assert cache.keys(short, SEED) == prefix_keys(short, BLOCK, STRIDE, SEED)
    assert cache.stats().prompts == 0
    for i in range(5):  # five conversations, each of its own head: the oldest go
        cache.keys(prompt(HEAD_TOKENS + 100, 10**6 * (i + 1)), SEED)
        assert cache.stats().tokens <= 3 * HEAD_TOKENS
    assert cache.stats().prompts == 2
    off = PrefixKeyCache(BLOCK, STRIDE, max_tokens=0)  # 0: no cache
    assert off.keys(prompt(HEAD_TOKENS * 2), SEED) == prefix_keys(
        prompt(HEAD_TOKENS * 2), BLOCK, STRIDE, SEED
    )
    assert off.stats().prompts == 0
