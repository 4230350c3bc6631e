"""Disaggregated fleets and peer pulls in the replayer: each request's path, the
transfers' figures, inter-token latency and goodput, the P/D sweep."""

import subprocess
import sys
from dataclasses import replace

import pytest

from loadtest.replay import ReplayConfig, replay
from loadtest.report import replay_row, weighted_percentile
from loadtest.workloads import ChatConfig, chat_workload
from router.policies import PolicyConfig
from tests.loadtest.test_replay_autoscale import SCALING

#: Chats beside long documents, a short reply each: what P/D is for, small.
DOCUMENTS = ChatConfig(
    num_sessions=24,
    session_rate=4.0,
    document_probability=0.5,
    document_tokens=6000,
    document_max_tokens=9000,
    reply_tokens=40,
)


def pd_fleet(prefill: int = 1, decode: int = 2, **config) -> ReplayConfig:
    return ReplayConfig(prefill=prefill, decode=decode, host_blocks=0, **config)


def test_a_disaggregated_request_is_prefilled_on_a_prefill_replica_and_decoded_on_another():
    result = replay(chat_workload(DOCUMENTS), pd_fleet(), "pd_always")
    records = result.records
    assert all(r.error is None and r.finish_s is not None for r in records)
    disaggregated = [r for r in records if r.path == "disaggregated"]
    assert disaggregated  # some prompts differ from all the decode replica holds
    for record in disaggregated:
        assert record.prefill_replica == 0 and record.replica in (1, 2)
        assert record.arrival_s < record.prefilled_s < record.first_token_s
    prefill, *decoders = result.engines
    assert sum(e.transfers.pulls for e in decoders) == len(disaggregated)
    prefill.leases.expire(result.duration_s)  # an idle engine unpins at its next step
    assert len(prefill.leases) == 0  # every hold ends with its pull, none timed out
    assert prefill.transfers.lent_blocks > 0 and prefill.transfers.hold_timeouts == 0
    row = replay_row(result)
    assert row["pd"] == "1:2" and row["disaggregated_share"] == len(disaggregated) / len(records)
    assert row["pulled_gb"] > 0 and row["pull_fallbacks"] == 0


def test_conditional_disaggregation_prefills_a_conversations_next_turn_in_place():
    """A later turn finds its history on the decode replica that served the last one:
    few tokens uncached there, so it is prefilled in place."""
    result = replay(chat_workload(DOCUMENTS), pd_fleet(), "pd_conditional")
    later = [r for r in result.records if r.turn > 0]
    assert later and sum(r.path == "local" for r in later) / len(later) > 0.8
    disaggregated = [r for r in result.records if r.path == "disaggregated"]
    assert disaggregated and all(r.prompt_tokens - r.cached_tokens > 256 for r in disaggregated)
    assert all(r.prompt_tokens > 6000 for r in disaggregated)  # the documents, not the chats


def test_the_cache_blind_pd_router_ignores_what_the_replicas_hold():
    workload = chat_workload(DOCUMENTS)
    blind = replay_row(replay(workload, pd_fleet(2, 2), "pd_blind"))
    aware = replay_row(replay(workload, pd_fleet(2, 2), "pd_always"))
    assert blind["disaggregated_share"] == 1.0 == aware["disaggregated_share"]
    assert aware["token_hit_rate"] > blind["token_hit_rate"] + 0.05


def test_peer_pulls_bring_a_hot_prompt_to_a_replica_new_to_it():
    hot = ChatConfig(
        num_apps=2,
        app_skew=2.0,
        system_prompt_tokens=2000,
        max_turns=1,
        num_sessions=60,
        session_rate=10.0,
        reply_tokens=20,
    )
    fleet = ReplayConfig(replicas=4, host_blocks=0, compute_scale=0.15)
    pulls = replace(fleet, routing=PolicyConfig.of(peer_pulls=True))
    result = replay(chat_workload(hot), pulls, "cache_aware")
    pulled = [r for r in result.records if r.path == "pulled"]
    assert pulled and all(r.cached_tokens >= 1984 for r in pulled)
    assert sum(e.transfers.pulls for e in result.engines) == len(pulled)
    without = replay(chat_workload(hot), fleet, "cache_aware")
    assert not any(r.path == "pulled" for r in without.records)
    assert replay_row(result)["token_hit_rate"] > replay_row(without)["token_hit_rate"]


def test_goodput_counts_the_requests_within_both_objectives():
    result = replay(chat_workload(DOCUMENTS), ReplayConfig(replicas=2, host_blocks=0))
    loose = replay_row(result)
    result.config = replace(result.config, slo_itl_s=1e-6)
    tight = replay_row(result)
    assert loose["slo_attainment"] > 0.5 and tight["slo_attainment"] < loose["slo_attainment"]
    assert tight["goodput_rps"] < loose["goodput_rps"]
    assert 0 < loose["itl_p50_s"] <= loose["itl_p99_s"]


def test_a_token_weighted_percentile():
    assert weighted_percentile([0.01, 0.5], [99, 1], 50) == 0.01
    assert weighted_percentile([0.01, 0.5], [98, 2], 99) == 0.5
    assert weighted_percentile([], [], 99) is None


#: A day (rising to four times its first rate and back) of long documents with short
#: answers (on which a decode pool that ignored the documents it prefills in place grew
#: to 4 and stalled its streams), and one of short prompts with long answers.
PREFILL_HEAVY = ChatConfig(
    rate_shape="day", session_rate=1.0, num_sessions=400, num_apps=2, think_time_s=4,
    mean_turns=2, document_probability=1.0, document_tokens=6000, reply_tokens=20,
)  # fmt: skip
DECODE_HEAVY = ChatConfig(
    rate_shape="day", session_rate=1.5, num_sessions=200, num_apps=2, think_time_s=4,
    system_prompt_tokens=200, reply_tokens=600,
)  # fmt: skip
POOLS = replace(SCALING, target_queued_prefill_tokens=8000)


@pytest.mark.parametrize(
    ("workload", "grows"), [(PREFILL_HEAVY, "prefill"), (DECODE_HEAVY, "decode")]
)
def test_each_pool_grows_and_shrinks_on_its_own_load_and_signal(workload, grows):
    config = pd_fleet(
        2, 2, capacity_blocks=4096, compute_scale=0.1, autoscale=POOLS, replica_startup_s=10
    )
    result = replay(chat_workload(workload), config, "pd_conditional")
    assert all(r.error is None and r.finish_s is not None for r in result.records)
    pools = {role: [n for _, n in sizes] for role, sizes in result.pool_sizes.items()}
    other = "decode" if grows == "prefill" else "prefill"
    assert max(pools[grows]) == 4 and max(pools[other]) <= 2  # the busy pool, alone
    assert replay_row(result)["itl_p99_s"] < 0.15  # no decode stream stalled
    assert pools[grows][-1] < 4 and pools[other][-1] == 1  # and shrink after noon
    row = replay_row(result)
    assert row[f"{grows}_peak"] == 4 and row["pool_sizes"][grows][0] == [0.0, 2]
    fixed = replay_row(
        replay(
            chat_workload(workload),
            pd_fleet(4, 4, capacity_blocks=4096, compute_scale=0.1),
            "pd_conditional",
        )
    )
    assert row["replica_hours"] < 0.6 * fixed["replica_hours"]  # 4P4D held all day


def test_a_pd_fleet_is_checked():
    with pytest.raises(ValueError, match="fleet"):
        ReplayConfig(prefill=1, decode=1, fleet="a=1,b=1")
    assert ReplayConfig(prefill=2, decode=3).replicas == 5
    assert ReplayConfig(prefill=2, decode=3).roles == ["prefill"] * 2 + ["decode"] * 3


def test_the_replay_command_sweeps_pd_splits():
    command = [
        sys.executable, "-m", "prefix_router", "replay", "--replicas", "3",
        "--policies", "pd_conditional", "--sweep", "pd=0:0,1:2", "--no-reference",
        "--no-progress", "--chat-num-sessions", "12", "--chat-document-probability", "0.5",
        "--chat-document-tokens", "4000",
    ]  # fmt: skip
    out = subprocess.run(command, capture_output=True, text=True, check=True).stdout
    assert "pd_conditional @ pd=0:0" in out and "pd_conditional @ pd=1:2" in out
    assert "KV that moved" in out and "goodput_rps" in out
