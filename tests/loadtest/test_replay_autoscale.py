"""A fleet that grows and shrinks in the replayer: a day-shaped load, replicas asked
for and started late, stopped only once their requests have ended, replica-hours."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace

import numpy as np
import pytest

from loadtest.replay import ReplayConfig, ReplayResult, replay
from loadtest.report import replay_row
from loadtest.workloads import ChatConfig, chat_workload, day_shaped
from router.fleet.autoscaler import AutoscaleConfig

#: A day in four minutes: sessions from a quarter of the peak rate to the peak and back.
DAY = ChatConfig(rate_shape="day", session_rate=1.5, num_sessions=300, num_apps=2, think_time_s=4)
FLEET = ReplayConfig(replicas=4, capacity_blocks=4096, host_blocks=0, compute_scale=0.1)
SCALING = AutoscaleConfig(
    min_replicas=1,
    max_replicas=4,
    target_ongoing_requests=8,
    upscale_delay_s=5,
    downscale_delay_s=20,
)


def scaled(scale_in: str = "cache") -> ReplayResult:
    config = replace(FLEET, autoscale=replace(SCALING, scale_in=scale_in), replica_startup_s=10)
    return replay(chat_workload(DAY), config, "cache_aware")


def test_the_day_shape_rises_four_times_and_falls_with_the_same_mean():
    rng = np.random.default_rng(0)
    flat = np.cumsum(rng.exponential(1.0, 40_000))
    day = day_shaped(flat)
    assert day[0] > flat[0] and day[-1] == pytest.approx(flat[-1])  # slow at first
    assert np.all(np.diff(day) >= 0)
    counts, _ = np.histogram(day, bins=20, range=(0, day[-1]))
    assert counts[9:11].mean() / counts[[0, -1]].mean() == pytest.approx(4, rel=0.15)
    assert day_shaped(np.array([3.0])).tolist() == [3.0]
    with pytest.raises(ValueError, match="rate_shape"):
        ChatConfig(rate_shape="week")


@pytest.mark.parametrize("scale_in", ["cache", "load", "random"])
def test_the_fleet_grows_with_the_day_and_shrinks_without_failing_a_request(scale_in):
    result = scaled(scale_in)
    fixed = replay(chat_workload(DAY), FLEET, "cache_aware")
    records = result.records
    assert len(records) == chat_workload(DAY).num_requests
    assert all(r.error is None and r.finish_s is not None for r in records)
    sizes = [n for _, n in result.fleet_sizes]
    peak = len(sizes) - 1 - sizes[::-1].index(max(sizes))  # its last peak
    assert sizes[1] < sizes[0] == 4 and max(sizes) >= 4  # down at the start, up by noon,
    assert peak > 1 and sizes[-1] == 1 < max(sizes[peak:])  # and down to one at night
    row, fixed_row = replay_row(result), replay_row(fixed)
    assert row["replica_hours"] < 0.95 * fixed_row["replica_hours"]
    assert fixed_row["replica_hours"] == pytest.approx(4 * fixed.duration_s / 3600)
    assert row["fleet_sizes"] and fixed_row["fleet_sizes"] is None
    events = result.scale_events
    assert {kind for _, kind, _ in events} == {"asked", "serving", "stopping", "stopped"}
    request_s = result.engines[0].cost.request_s
    for at, kind, index in events:
        on_it = [r for r in records if r.replica == index]
        if kind == "stopping":  # out of routing from then on
            assert all(r.dispatched_s <= at for r in on_it)
        if kind == "stopped":  # and stopped once all it held had ended
            assert all(r.finish_s - request_s <= at + 1e-9 for r in on_it)  # type: ignore[operator]
        if kind == "serving":  # a new replica starts empty and serves at once
            asked = [t for t, k, i in events if k == "asked" and i == index]
            assert asked and at - asked[0] >= 10  # its start-up
    # each replica asked for served, or was no longer wanted before it could
    assert sum(k == "serving" for _, k, _ in events) <= sum(k == "asked" for _, k, _ in events)


def test_the_command_line_scales_and_reports_replica_hours(tmp_path):
    out = tmp_path / "report.json"
    flags = (
        "--workload chat --chat-rate-shape day --chat-num-sessions 80 --chat-session-rate 1 "
        "--replicas 2 --min-replicas 1 --max-replicas 3 --target-ongoing-requests 4 "
        "--downscale-delay-s 10 --policies cache_aware --no-reference"
    )
    command = [sys.executable, "-m", "prefix_router", "replay", *flags.split(), "--json", str(out)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "the fleet's size" in done.stdout and "replica_hours" in done.stdout
    (row,) = json.loads(out.read_text())["rows"]
    assert row["replica_hours"] > 0 and row["fleet_sizes"][0] == [0.0, 2]
    unbounded = [*command[:-5], "--min-replicas", "3", "--max-replicas", "2"]
    bad = subprocess.run(unbounded, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "min_replicas" in bad.stderr
