"""Ties broken as numpy breaks them: the same picks from the same generator."""

import numpy as np
import pytest

from router.policies.ties import Ties


def test_the_picks_are_numpys_draw_for_draw_among_other_draws():
    ours, theirs = np.random.default_rng(7), np.random.default_rng(7)
    ties = Ties(ours)
    sizes = np.random.default_rng(1)
    for n in sizes.choice([2, 3, 4, 5, 7, 8, 100, 1000, 2**31 + 11, 2**32], 50_000):
        if sizes.random() < 0.2:  # 64-bit draws between: the spare half waits
            assert ours.random() == theirs.random()
        assert ties.below(int(n)) == int(theirs.integers(int(n)))


def test_an_empty_choice_is_refused():
    with pytest.raises(ValueError):
        Ties(np.random.default_rng()).below(0)
