"""The bench's charts: drawn for every kind of row, without matplotlib's warnings."""

import warnings

from loadtest import bench_cli
from loadtest.timeline import Timeline


def rows() -> list[dict]:
    ours = {
        "label": "cache_aware",
        "policy": "cache_aware",
        "token_hit_rate": 0.9,
        "client_token_hit_rate": 0.9,
        "ttft_p50_s": 0.01,
        "ttft_p99_s": 0.03,
        "requests_per_replica": [10, 12],
    }
    # A router the bench measured from outside: a label, no per-replica counts.
    foreign = {
        "label": "their_router",
        "policy": None,
        "token_hit_rate": 0.8,
        "ttft_p50_s": 0.02,
        "requests_per_replica": [],
    }
    return [ours, foreign]


def timelines() -> dict[str, Timeline]:
    sampled = Timeline(
        start=0.0,
        times=[1.0, 2.0],
        outstanding=[[1, 0], [2, 1]],
        cached=[[0.1, 0.0], [0.3, 0.2]],
        in_use=[[0.05, 0.0], [0.1, 0.1]],
    )
    sampled.add_answers([(0.5, 0.01, 100, 50), (12.0, 0.02, 100, 90)])
    return {"cache_aware": sampled, "their_router": Timeline(start=0.0)}  # nothing sampled


def test_every_chart_is_drawn_for_our_rows_and_a_foreign_one_without_a_warning(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # an empty legend, say, fails the test
        charts = bench_cli.write_charts(tmp_path, rows(), timelines())
    assert {
        "hit_rate_over_time.png",
        "ttft_over_time.png",
        "replica_load.png",
        "cache_occupancy.png",
        "load.png",
    } <= set(charts)
    assert all((tmp_path / name).stat().st_size > 0 for name in charts)


def test_a_report_of_one_foreign_router_draws_no_empty_legend(tmp_path):
    # `bench --gateway URL --policies LABEL` in front of a router that is not ours.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        bench_cli.write_charts(tmp_path, rows()[1:], {"their_router": Timeline(start=0.0)})
