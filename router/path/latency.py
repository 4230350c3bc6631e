"""Latency histograms the gateway keeps: fixed buckets, one counter per bucket.

Observing is a bisection and an increment (no lock, no allocation), so the request
path can afford it; quantiles are estimated at read time from the counts, or from
the difference of two snapshots of them (a time window), as Prometheus's
``histogram_quantile`` does.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence

import numpy as np

#: Seconds; vLLM's time-to-first-token buckets up to 10 s (the replica's, too).
TTFT_BUCKETS: tuple[float, ...] = (
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    10.0,
)


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile of ``values``; ``None`` for no values (never a made-up 0).
    The project's one helper for exact percentiles (histograms have :func:`quantile`)."""
    return float(np.percentile(values, q)) if len(values) else None


class LatencyHistogram:
    """Counts per bucket (``counts[i]``: observations <= ``bounds[i]``, not cumulative;
    the last count is above every bound) and their sum."""

    def __init__(self, bounds: Sequence[float] = TTFT_BUCKETS) -> None:
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)
        self.sum_s = 0.0

    def observe(self, seconds: float) -> None:
        self.counts[bisect_left(self.bounds, seconds)] += 1
        self.sum_s += seconds

    @property
    def count(self) -> int:
        return sum(self.counts)

    def snapshot(self) -> tuple[int, ...]:
        return tuple(self.counts)


def quantile(bounds: Sequence[float], counts: Sequence[int], q: float) -> float | None:
    """The ``q`` quantile of bucket ``counts``, linear within its bucket (as Prometheus
    estimates it); ``None`` without observations. Above the last bound: that bound."""
    total = sum(counts)
    if total <= 0:
        return None
    rank, seen, lower = q * total, 0, 0.0
    for bound, count in zip(bounds, counts, strict=False):
        if count and seen + count >= rank:
            return lower + (bound - lower) * (rank - seen) / count
        seen, lower = seen + count, bound
    return bounds[-1]


def difference(later: Sequence[int], earlier: Sequence[int]) -> list[int]:
    """Counts observed between two snapshots."""
    return [a - b for a, b in zip(later, earlier, strict=True)]
