"""``prefix-router bench``: short live comparisons, and their reports checked for
consistency (engine against client, replay against live, counts against counts)."""

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from deploy.processes import running
from loadtest.bench import BenchConfig
from replica.api.cost_model import StepCosts
from replica.api.fleet_token import ENV_FLEET_TOKEN

pytestmark = pytest.mark.slow

TOKEN = "the-fleets-token"

#: A few short sessions: the whole comparison takes seconds.
TINY = shlex.split(
    "--chat-num-sessions 8 --chat-session-rate 4 --chat-think-time-s 0.3 "
    "--chat-reply-tokens 12 --chat-user-tokens 20 --users 8 --run-time 60 --no-progress"
)


def bench(out: Path, *arguments: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "prefix_router", "bench", "--out", str(out), *TINY, *arguments]
    return subprocess.run(command, capture_output=True, text=True, timeout=300, check=False)


def token_file(folder: Path) -> Path:
    path = folder / "fleet-token"
    path.write_text(TOKEN)
    return path


def expected_requests() -> int:
    chat = {"num_sessions": 8, "session_rate": 4.0, "think_time_s": 0.3, "reply_tokens": 12}
    return BenchConfig(chat={**chat, "user_tokens": 20}).load().num_requests


#: The tiny model's step costs on one core of this machine, as `prefix-router calibrate`
#: fitted them (2026-12-02): the replay's twin of a vLLM fleet is timed by them.
TINY_ON_A_CORE = StepCosts(
    step_s=7.65e-3, seq_s=0.143e-3, token_s=38.1e-6, attention_pair_s=71.8e-9
)

#: How far a live hit rate may land from the replay's prediction of the same run: the
#: docs/results.md shows agreement, the bench flags rows beyond 5 points.
LIVE_REPLAY_GAP = 0.03


def played_requests(meta: dict) -> int:
    """The requests of the workload the report says it played (its chat load)."""
    chat = {k: v for k, v in meta["chat"].items() if k != "seed"}
    return BenchConfig(chat=chat, seed=meta["seed"]).load().num_requests


def check_report(out: Path, policies: list[str], replayed: bool = True) -> list[dict]:
    report = json.loads((out / "report.json").read_text())
    rows = report["rows"]
    assert [r["label"] for r in rows] == policies
    requests = played_requests(report["meta"])
    assert report["meta"]["sizing"] is not None or requests == expected_requests()
    for row in rows:
        # Every session was played to the end, without a failure...
        assert row["requests"] == requests and row["failures"] == 0
        assert sum(row["requests_per_replica"]) == requests
        # ...so what the clients read in the usage blocks is what the engines counted.
        assert row["client_cached_tokens"] == row["cached_tokens"] > 0
        assert row["client_token_hit_rate"] == row["token_hit_rate"]
        assert 0 < row["ttft_p50_s"] <= row["ttft_p90_s"] <= row["ttft_p99_s"]
        assert row["imbalance"] >= 1.0 and 0.0 <= row["cpu_busy"] <= 1.0
        if replayed:
            live, replay = row["token_hit_rate"], row["replay_token_hit_rate"]
            assert abs(live - replay) <= LIVE_REPLAY_GAP, (
                f"{row['label']}: live hit rate {live:.3f}, replay {replay:.3f}"
            )
            assert row["replay_differs"] is False
            # The replay played the very prompts the engines read, token for token.
            assert row["replay_prompt_tokens"] == row["client_prompt_tokens"]
        else:
            assert row["replay_token_hit_rate"] is None and row["replay_differs"] is None
    assert 0.0 <= report["meta"]["cpu_busy"] <= 1.0
    markdown = (out / "report.md").read_text()
    if replayed:
        assert f"agree within 5 points: {', '.join(policies)}." in markdown
    else:  # nothing compared, nothing claimed
        assert "agree within" not in markdown and "Not compared with a replay" in markdown
    assert all(re.search(rf"\|\s+{p} \|", markdown) for p in policies)
    comparisons = ["hit_rate.png", "ttft.png", "load.png"]
    over_time = ["hit_rate_over_time.png", "ttft_over_time.png", "replica_load.png"]
    charts = [*comparisons, *over_time, "cache_occupancy.png"]
    assert all((out / chart).stat().st_size > 0 for chart in charts)
    assert all(f"({chart})" in markdown for chart in charts)  # embedded in the report
    return rows


def test_bench_compares_policies_through_our_gateway(tmp_path):
    replica = ["replica", "--speedup", "4", "--num-blocks", "512"]
    with running(replica, replica) as replicas:
        gateway = ["gateway", *[f"--backend={url}" for url in replicas]]
        with running(gateway) as (url,):
            done = bench(tmp_path, "--gateway", url)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "report:" in done.stdout and "| cache_aware" in done.stdout
    rows = check_report(tmp_path, ["round_robin", "cache_aware_approx", "cache_aware"])
    # Per request, the router's predicted cached tokens land within one stride of what
    # the engine reported (round robin predicts nothing: unknown, not zero).
    assert rows[0]["prediction_accuracy"] is None
    assert rows[1]["prediction_accuracy"] >= 0.9 and rows[2]["prediction_accuracy"] >= 0.95
    # Every over-prediction is counted with its cause.
    for row in rows[1:]:
        causes = ("pending", "evicted", "unexplained")
        by_cause = sum(row[f"prediction_over_{cause}"] for cause in causes)
        assert by_cause == pytest.approx(row["prediction_over"])
    assert all(r["replicas"] == 2 and r["capacity_blocks"] == 512 for r in rows)


def test_bench_sizes_its_load_to_the_engines_it_runs_on(tmp_path):
    replica = ["replica", "--speedup", "4", "--num-blocks", "512"]
    with running(replica, replica) as replicas:
        gateway = ["gateway", *[f"--backend={url}" for url in replicas]]
        with running(gateway) as (url,):
            done = bench(
                tmp_path, "--gateway", url, "--policies", "cache_aware", "--size-load", "0.3"
            )
    assert done.returncode == 0, done.stderr[-3000:]
    meta = json.loads((tmp_path / "report.json").read_text())["meta"]
    sizing, chat = meta["sizing"], meta["chat"]
    # The twin's engines, routed round robin, are busy the asked share of the time
    # while sessions arrive, as long as the given load's did (8 at 4 a second): close,
    # as a few sessions, each another draw of turns, allow.
    assert sizing["busy_share"] == pytest.approx(0.3, rel=0.1)
    assert (chat["session_rate"], chat["num_sessions"]) == (
        sizing["session_rate"],
        sizing["num_sessions"],
    )
    assert sizing["num_sessions"] == round(sizing["session_rate"] * 2) != 8
    # Our replicas' twin is exact: no engine timed.
    assert sizing["profile"] == "" and not (tmp_path / "calibration").exists()
    check_report(tmp_path, ["cache_aware"])  # every sized session played, replay beside
    markdown = (tmp_path / "report.md").read_text()
    assert f"sessions at {sizing['session_rate']:.2f} per second" in markdown
    assert "load sized to the engines" in done.stderr


def test_bench_puts_sglangs_router_beside_ours_on_the_same_replicas(tmp_path):
    replica = ["replica", "--speedup", "4", "--num-blocks", "512"]
    # replicas that answer only the fleet's token: the bench, our gateway and SGLang's
    # router (its --api-key) each carry it
    token = ["--fleet-token-file", str(token_file(tmp_path))]
    with running(replica, replica, env={ENV_FLEET_TOKEN: TOKEN}) as replicas:
        gateway = ["gateway", *[f"--backend={url}" for url in replicas], *token]
        with running(gateway) as (url,):
            policies = ["--policies", "round_robin,cache_aware", "--with-sglang"]
            done = bench(tmp_path, "--gateway", url, *policies, *token)
            # SGLang's router was started for its row and stopped after it.
            assert not [
                p
                for p in psutil.process_iter(["cmdline"])
                if "sglang_router" in " ".join(p.info["cmdline"] or [])
                and replicas[0] in " ".join(p.info["cmdline"])
            ]
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"live dashboard at {url}/dashboard" in done.stderr
    # The same replicas, emptied before each row: every row counts the whole workload.
    rows = check_report(tmp_path, ["round_robin", "cache_aware", "sglang_router"])
    theirs = rows[2]
    assert theirs["policy"] is None and theirs["replicas"] == 2
    assert theirs["prediction_accuracy"] is None  # their router predicts nothing we can read
    timelines = json.loads((tmp_path / "timelines.json").read_text())
    assert list(timelines) == ["round_robin", "cache_aware", "sglang_router"]
    for row in rows:
        timeline = timelines[row["label"]]
        assert len(timeline["answers"]) == row["requests"]
        assert timeline["times"] and all(len(s) == 2 for s in timeline["outstanding"])


@pytest.mark.ray
def test_bench_puts_our_router_inside_ray_serve_beside_our_gateway(tmp_path):
    replica = ["replica", "--speedup", "4", "--num-blocks", "512"]
    with running(replica, replica) as replicas:
        gateway = ["gateway", *[f"--backend={url}" for url in replicas]]
        with running(gateway) as (url,):
            # One Serve row: each starts a Ray and Serve of its own (a minute under CI);
            # Serve's own routers differ only in the application's settings
            # (test_ray_serve_rows.py), and serve the same application (test_ray_serve.py).
            policies = "serve_cache_aware"
            done = bench(tmp_path, "--gateway", url, "--policies", policies)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "starting Ray Serve with 2 engines for serve_cache_aware" in done.stderr
    # The Serve row ran engines like the gateway's replicas, on a Ray of its own, and its
    # twin (ours as its policy) agreed with it.
    rows = check_report(tmp_path, [policies])
    assert all(r["replicas"] == 2 and r["capacity_blocks"] == 512 for r in rows)
    config = (tmp_path / "serve_cache_aware" / "serve" / "serve_config.yaml").read_text()
    assert "router: prefix" in config and "policy: cache_aware" in config
    assert (
        not [  # `serve run` stopped after its row
            p
            for p in psutil.process_iter(["cmdline"])
            if str(tmp_path) in " ".join(p.info["cmdline"] or [])
        ]
    )


@pytest.mark.ray
def test_bench_runs_its_own_embedded_deployment_with_two_gateways_and_stops_it(tmp_path):
    fleet = shlex.split("--replicas 2 --gateways 2 --replica-speedup 4")
    done = bench(tmp_path, *fleet, "--policies", "cache_aware", "--no-replay")
    assert done.returncode == 0, done.stderr[-3000:]
    (row,) = check_report(tmp_path, ["cache_aware"], replayed=False)
    meta = json.loads((tmp_path / "report.json").read_text())["meta"]
    assert "2 gateways" in meta["target"] and "requests spread at random" in meta["target"]
    # Both gateways routed, and between them every request.
    routed = row["requests_per_gateway"]
    assert len(routed) == 2 and min(routed) > 0 and sum(routed) == row["requests"]
    assert row["prediction_accuracy"] is not None
    leftover = subprocess.run(
        ["pgrep", "-f", "prefix_router serve"], capture_output=True, check=False
    )
    assert leftover.stdout == b""


def test_bench_against_a_plain_openai_server_runs_one_labelled_policy(tmp_path):
    with running(["replica", "--speedup", "4"]) as (url,):
        refused = bench(tmp_path, "--gateway", url)
        assert refused.returncode == 2 and "cannot switch its policy" in refused.stderr
        done = bench(tmp_path, "--gateway", url, "--policies", "one_server")
    assert done.returncode == 0, done.stderr[-3000:]
    (row,) = check_report(tmp_path, ["one_server"])
    assert row["replicas"] == 1 and row["imbalance"] == 1.0


def test_bench_puts_vllms_pd_router_beside_ours_on_a_disaggregated_fleet(tmp_path):
    replica = ["replica", "--speedup", "4", "--num-blocks", "1024"]
    roles = ([*replica, "--role", "prefill"], [*replica, "--role", "decode"])
    with running(*roles) as replicas:
        gateway = ["gateway", *[f"--backend={url}" for url in replicas]]
        with running(gateway) as (url,):
            policies = "cache_aware,pd_conditional,vllm_router_pd"
            done = bench(tmp_path, "--gateway", url, "--policies", policies)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "goodput (TTFT <= 2.0 s" in done.stdout
    rows = json.loads((tmp_path / "report.json").read_text())["rows"]
    assert [r["label"] for r in rows] == policies.split(",")
    for row in rows:
        assert row["requests"] == expected_requests() and row["failures"] == 0
        assert row["goodput_rps"] > 0 and 0 < row["slo_attainment"] <= 1
        assert 0 < row["itl_p50_s"] <= row["itl_p99_s"]
    ours, conditional, theirs = rows
    for row in (ours, conditional):  # beside its twin: a 1P1D fleet in replay
        assert abs(row["token_hit_rate"] - row["replay_token_hit_rate"]) <= LIVE_REPLAY_GAP
        assert row["replay_goodput_rps"] > 0
    assert theirs["policy"] is None and theirs["replay_goodput_rps"] is None
