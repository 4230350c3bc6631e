"""The gateway's counters sampled while the dashboard is open, for rates and charts.

A sample is taken when a refresh asks and the last one is at least
``dashboard_sample_s`` old, and kept for ``dashboard_history_s``: memory is bounded by
their ratio whatever the traffic, and nothing is sampled while nobody looks. Rates
(hit rate over the last minute, decisions per second) are differences between now
and the oldest sample in the window; the charts' points are differences between
consecutive samples, per policy.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field

from router.config import DashboardConfig
from router.path.latency import TTFT_BUCKETS, difference, quantile


@dataclass(frozen=True)
class PolicySample:
    requests: int
    prompt_tokens: int
    cached_tokens: int
    predictions: int
    close_predictions: int
    ttft: tuple[int, ...]


@dataclass(frozen=True)
class ReplicaSample:
    dispatched: int
    #: The replica's own prompt tokens looked up and found (``None``: it did not say).
    query_tokens: int | None
    hit_tokens: int | None


@dataclass(frozen=True)
class Sample:
    ts: float
    policies: Mapping[str, PolicySample]
    replicas: Mapping[str, ReplicaSample]


@dataclass(frozen=True)
class Point:
    """One policy between two samples: what the charts draw."""

    ts: float
    token_hit_rate: float | None
    ttft_p50_s: float | None
    ttft_p90_s: float | None
    prediction_accuracy: float | None
    requests_per_s: float


@dataclass(frozen=True)
class ReplicaRates:
    window_s: float
    decisions_per_s: float
    token_hit_rate: float | None


@dataclass
class History:
    config: DashboardConfig
    samples: deque[Sample] = field(default_factory=deque)

    def add(self, sample: Sample) -> None:
        """Keep ``sample`` if the last one is old enough; forget those past the history."""
        if self.samples and sample.ts - self.samples[-1].ts < self.config.dashboard_sample_s:
            return
        self.samples.append(sample)
        horizon = sample.ts - self.config.dashboard_history_s
        while self.samples and self.samples[0].ts < horizon:
            self.samples.popleft()

    def window_start(self, now: Sample, replica: str) -> Sample | None:
        """The oldest sample within the window before ``now`` in which ``replica`` gave
        its figures (``None``: none yet). A refresh whose fetch of a replica's ``/stats``
        timed out does not blank that replica's rates for a whole window."""
        start = now.ts - self.config.dashboard_window_s
        return next(
            (
                s
                for s in self.samples
                if start <= s.ts < now.ts
                and (figures := s.replicas.get(replica)) is not None
                and figures.query_tokens is not None
            ),
            None,
        )

    def points(self, since: float) -> dict[str, list[Point]]:
        """Per policy, a point for each pair of consecutive samples after ``since``."""
        series: dict[str, list[Point]] = {}
        for before, after in itertools.pairwise(self.samples):
            if after.ts <= since:
                continue
            for name, later in after.policies.items():
                point = _point(before.policies.get(name), later, after.ts - before.ts, after.ts)
                if point is not None:
                    series.setdefault(name, []).append(point)
        return series


def replica_rates(now: ReplicaSample, start: ReplicaSample | None, seconds: float) -> ReplicaRates:
    """A replica's decisions per second and token hit rate between two samples."""
    if start is None or seconds <= 0:
        return ReplicaRates(0.0, 0.0, None)
    decisions = max(0, now.dispatched - start.dispatched) / seconds
    rate = None
    if None not in (now.query_tokens, now.hit_tokens, start.query_tokens, start.hit_tokens):
        queries = now.query_tokens - start.query_tokens  # type: ignore[operator]
        hits = now.hit_tokens - start.hit_tokens  # type: ignore[operator]
        rate = hits / queries if queries > 0 and hits >= 0 else None  # < 0: it was reset
    return ReplicaRates(seconds, decisions, rate)


def _point(
    before: PolicySample | None, after: PolicySample, seconds: float, ts: float
) -> Point | None:
    """``None`` when the policy routed nothing between the two samples."""
    before = before or PolicySample(0, 0, 0, 0, 0, (0,) * len(after.ttft))
    requests = after.requests - before.requests
    if requests <= 0:
        return None
    prompt = after.prompt_tokens - before.prompt_tokens
    cached = after.cached_tokens - before.cached_tokens
    ttft = difference(after.ttft, before.ttft)
    predictions = after.predictions - before.predictions
    close = after.close_predictions - before.close_predictions
    return Point(
        ts,
        cached / prompt if prompt > 0 else None,
        quantile(TTFT_BUCKETS, ttft, 0.5),
        quantile(TTFT_BUCKETS, ttft, 0.9),
        close / predictions if predictions > 0 else None,
        requests / seconds,
    )
