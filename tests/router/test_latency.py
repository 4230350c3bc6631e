"""The gateway's latency histograms: bucket counts, and quantiles read from them."""

import pytest

from router.path.latency import LatencyHistogram, difference, percentile, quantile


def test_observations_fall_in_their_bucket_and_quantiles_interpolate():
    histogram = LatencyHistogram((0.1, 0.2, 0.4))
    for seconds in (0.05, 0.1, 0.15, 0.3, 9.0):
        histogram.observe(seconds)
    assert histogram.counts == [2, 1, 1, 1] and histogram.count == 5
    assert quantile(histogram.bounds, histogram.counts, 0.5) == pytest.approx(0.15)
    assert quantile(histogram.bounds, histogram.counts, 1.0) == 0.4  # beyond the last bound
    assert quantile(histogram.bounds, [0, 0, 0, 0], 0.5) is None


def test_a_window_is_the_difference_of_two_snapshots():
    histogram = LatencyHistogram((0.1, 0.2))
    histogram.observe(0.05)
    before = histogram.snapshot()
    histogram.observe(0.15)
    window = difference(histogram.snapshot(), before)
    assert window == [0, 1, 0]
    assert quantile(histogram.bounds, window, 0.5) == pytest.approx(0.15)


def test_exact_percentiles_interpolate_and_say_none_for_no_values():
    assert percentile([0.3, 0.1, 0.2], 50) == pytest.approx(0.2)
    assert percentile([0.1, 0.2], 99) == pytest.approx(0.199)
    assert percentile([], 50) is None  # never a made-up 0
