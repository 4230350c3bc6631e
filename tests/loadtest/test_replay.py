"""The offline replayer: the seed chapter's experiment, sweeps, determinism, the CLI."""

import json
import subprocess
import sys
from dataclasses import replace

import pytest

from loadtest.replay import ReplayConfig, replay
from loadtest.report import ROW_KEYS, replay_row
from loadtest.workloads import ChatConfig, chat_workload, load_workload
from tests.shared import MOONCAKE_TRACE

SMALL = ChatConfig(num_sessions=60, session_rate=4.0)


def test_the_seed_experiment_lands_near_the_chapters_figures():
    row = replay_row(replay(chat_workload(), ReplayConfig(replicas=1)))
    assert row["failures"] == 0 and row["requests"] == chat_workload().num_requests
    assert 0.75 <= row["block_hit_rate"] <= 0.85, row["block_hit_rate"]  # seed: about 80%
    assert 0.73 <= row["token_hit_rate"] <= 0.83, row["token_hit_rate"]  # seed: about 78%
    assert row["block_hit_rate"] >= row["token_hit_rate"]
    assert row["prefill_tokens_saved"] == row["cached_tokens"] > 0
    assert row["evictions"] > 0  # the default capacity cannot hold everything
    assert row["shared_prefix_evictions"] == 0
    assert row["shared_prefix_hit_rate"] > 0.99


def test_the_capacity_sweep_shows_leaf_only_lru_protecting_the_shared_prefix():
    workload = chat_workload(replace(SMALL, num_apps=1))
    rows = [
        replay_row(replay(workload, ReplayConfig(capacity_blocks=c))) for c in (256, 1024, 8192)
    ]
    hit_rates = [r["token_hit_rate"] for r in rows]
    assert hit_rates == sorted(hit_rates) and hit_rates[0] < hit_rates[-1]
    assert rows[0]["evictions"] > rows[-1]["evictions"]
    for row in rows:  # history is evicted, the system prompt with sessions hanging off it is not
        assert row["shared_prefix_evictions"] == 0
        assert row["shared_prefix_hit_rate"] > row["token_hit_rate"]


def test_the_same_seed_reproduces_the_same_report():
    first = replay_row(replay(chat_workload(SMALL), ReplayConfig()))
    second = replay_row(replay(chat_workload(SMALL), ReplayConfig()))
    assert first == second


def test_rows_have_the_shared_shape_with_latency_figures():
    row = replay_row(replay(chat_workload(SMALL), ReplayConfig(replicas=2)))
    assert list(row)[: len(ROW_KEYS)] == list(ROW_KEYS)
    assert row["replicas"] == 2 and row["imbalance"] == pytest.approx(1.0, abs=0.05)
    assert 0 < row["ttft_p50_s"] <= row["ttft_p90_s"] <= row["ttft_p99_s"] < row["e2e_p50_s"] * 10
    assert row["throughput_rps"] > 0
    assert row["prediction_accuracy"] is None  # round robin predicts nothing: unknown, not made up


def test_closed_loop_users_play_every_session():
    workload = chat_workload(replace(SMALL, arrival="closed", num_users=4))
    result = replay(workload, ReplayConfig())
    assert len(result.records) == workload.num_requests
    assert all(r.finish_s is not None for r in result.records)


def test_a_trace_replays_at_its_timestamps():
    workload = load_workload(f"trace:{MOONCAKE_TRACE}", {"limit": 40})
    result = replay(workload, ReplayConfig(capacity_blocks=16384))
    row = replay_row(result)
    assert row["requests"] == 40 and row["failures"] == 0
    assert row["token_hit_rate"] > 0  # every request shares hash id 0
    arrivals = sorted(r.arrival_s for r in result.records)
    assert arrivals == sorted(s.start_time_s for s in workload.sessions)


def test_requests_larger_than_the_cache_are_failures_not_crashes():
    workload = load_workload(f"trace:{MOONCAKE_TRACE}", {"limit": 10})
    row = replay_row(replay(workload, ReplayConfig(capacity_blocks=256)))
    assert row["failures"] > 0 and row["requests"] == 10


def test_the_command_line_prints_a_sweep_and_writes_json(tmp_path):
    out = tmp_path / "rows.json"
    command = [
        sys.executable, "-m", "deploy.cli", "replay", "--workload", "chat", "--replicas", "1",
        "--policies", "round_robin", "--chat-num-sessions", "30", "--sweep-capacity", "512,4096",
        "--json", str(out), "--no-progress",
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    assert "block_hit_rate" in done.stdout and "prefill_tokens_saved" in done.stdout
    report = json.loads(out.read_text())
    labels = [r["label"] for r in report["rows"]]
    assert labels == [
        "round_robin @ capacity_blocks=512", "infinite_cache @ capacity_blocks=512",
        "round_robin @ capacity_blocks=4096", "infinite_cache @ capacity_blocks=4096",
    ]  # fmt: skip
    assert [r["capacity_blocks"] for r in report["rows"]] == [512, 512, 4096, 4096]
    assert report["meta"]["seed"] == 0 and "replay" in report["meta"]["command"]


def test_the_command_line_explains_bad_input():
    done = subprocess.run(
        [sys.executable, "-m", "deploy.cli", "replay", "--workload", "nope"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 2 and "unknown workload" in done.stderr
