"""The dashboard's samples: bounded in time, rates over the window, points per policy."""

import pytest

from router.config import DashboardConfig
from router.http.dashboard.history import (
    History,
    PolicySample,
    ReplicaSample,
    Sample,
    replica_rates,
)
from router.path.latency import TTFT_BUCKETS

CONFIG = DashboardConfig(dashboard_sample_s=1.0, dashboard_history_s=10.0, dashboard_window_s=4.0)
NO_TTFT = (0,) * (len(TTFT_BUCKETS) + 1)


def sample(ts: float, requests: int, cached: int, dispatched: int, hits: int) -> Sample:
    ttft = list(NO_TTFT)
    ttft[2] = requests  # every first token within 10-20 ms
    policy = PolicySample(requests, 100 * requests, cached, requests, requests // 2, tuple(ttft))
    return Sample(ts, {"cache_aware": policy}, {"r0": ReplicaSample(dispatched, 100 * hits, hits)})


def test_samples_are_thinned_and_forgotten_past_the_history():
    history = History(CONFIG)
    for ts in (0.0, 0.5, 1.0, 5.0, 12.0):
        history.add(sample(ts, 0, 0, 0, 0))
    assert [s.ts for s in history.samples] == [5.0, 12.0]  # 0.5 too soon; 0, 1 too old


def test_rates_are_over_the_window_and_points_between_samples():
    history = History(CONFIG)
    for ts, requests in ((0.0, 0), (1.0, 10), (2.0, 30)):
        history.add(sample(ts, requests, 40 * requests, requests, 50 * requests))
    now = sample(4.5, 40, 1600, 40, 2000)
    start = history.window_start(now, "r0")
    assert start is not None and start.ts == 1.0  # 0.0 is older than 4 s
    rates = replica_rates(now.replicas["r0"], start.replicas["r0"], now.ts - start.ts)
    assert rates.decisions_per_s == pytest.approx(30 / 3.5)
    assert rates.token_hit_rate == pytest.approx(0.01)

    points = history.points(since=1.0)["cache_aware"]
    assert [p.ts for p in points] == [2.0]
    (point,) = points
    assert point.token_hit_rate == pytest.approx(0.4) and point.requests_per_s == 20
    assert point.prediction_accuracy == pytest.approx(0.5)
    assert 0.01 < point.ttft_p50_s < 0.02


def test_a_replica_reset_gives_no_rate_rather_than_a_negative_one():
    rates = replica_rates(ReplicaSample(5, 10, 5), ReplicaSample(3, 100, 50), 2.0)
    assert rates.token_hit_rate is None and rates.decisions_per_s == 1.0


def test_a_replica_that_did_not_answer_a_refresh_keeps_its_window():
    """A refresh whose fetch of the replica's /stats timed out holds no figures for it:
    its rates run from the oldest sample that has them, not from nothing."""
    history = History(CONFIG)
    silent = Sample(1.0, {}, {"r0": ReplicaSample(0, None, None)})
    history.add(silent)
    history.add(sample(2.0, 10, 400, 10, 500))
    now = sample(4.5, 40, 1600, 40, 2000)
    start = history.window_start(now, "r0")
    assert start is not None and start.ts == 2.0
    assert history.window_start(now, "r1") is None  # a replica no sample knows
