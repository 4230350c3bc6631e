"""The prompt beginnings counted for the dashboard: bounded, decaying, no prompt copied twice."""

import numpy as np

from router.index.hot_prefixes import HotPrefixes
from tests.shared import prompt


def test_requests_are_counted_by_their_leading_identity():
    hot = HotPrefixes(kept=8, half_life=1000, sample_tokens=4)
    for turn in range(5):
        hot.record([1, 10 + turn], prompt(128))
    hot.record([2], prompt(64, start=500))
    hot.record([], prompt(8))  # shorter than a stride: nothing to count
    first, second = hot.top(2)
    assert (first.leading, first.requests, list(first.stride_hashes)) == (1, 5, [1, 14])
    assert (second.leading, second.requests) == (2, 1)
    assert np.array_equal(first.tokens, prompt(4))  # the first prompt's first tokens


def test_counts_halve_and_the_table_stays_bounded():
    hot = HotPrefixes(kept=3, half_life=10, sample_tokens=0)
    for leading in range(100):
        hot.record([leading], prompt(64))
        assert len(hot) <= 3 + 10
    for _ in range(10):
        hot.record([7], prompt(64))
    assert hot.top(1)[0].leading == 7 and hot.top(1)[0].requests == 5  # 10, halved once
