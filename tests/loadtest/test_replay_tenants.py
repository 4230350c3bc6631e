"""Tenants in the replayer: a router's queue when replicas are at ``max_outstanding``,
served first come first served, by VTC or by the prefill each tenant causes."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

import numpy as np
import pytest

from loadtest.replay import ReplayConfig, ReplayResult, replay
from loadtest.report import jain_fairness, max_min_shares, replay_row
from loadtest.workloads import ChatConfig, chat_workload
from loadtest.workloads.base import Session, Turn, Workload

#: Two steady tenants and one sending 8 times their sessions, on a fleet they saturate.
TENANTS = ChatConfig(tenants="a=1,b=1,noisy=8", session_rate=0.3, num_sessions=12, num_apps=1)
FLEET = ReplayConfig(
    replicas=2, capacity_blocks=2048, host_blocks=0, max_outstanding=8, compute_scale=0.3
)


def run(fairness: str) -> dict:
    result = replay(chat_workload(TENANTS), replace(FLEET, fairness=fairness), "cache_aware")
    assert all(r.error is None and r.finish_s is not None for r in result.records)
    assert max(r.dispatched_s - r.arrival_s for r in result.records) > 0  # some waited
    most, cap = max_in_flight(result), FLEET.max_outstanding
    if fairness == "fcfs":
        assert most == cap  # reached, never passed
    else:  # a light tenant may pass it on its prompt's replica, up to twice (router/fair/slots.py)
        assert cap <= most <= 2 * cap
    return replay_row(result, fairness)


def max_in_flight(result: ReplayResult) -> int:
    """The most requests any replica held at once, from dispatch to the engine's end."""
    request_s = result.engines[0].cost.request_s
    most = 0
    for replica in range(len(result.engines)):
        ends = [(r.finish_s - request_s, -1) for r in result.records if r.replica == replica]
        starts = [(r.dispatched_s, 1) for r in result.records if r.replica == replica]
        held = 0
        for _, change in sorted(ends + starts):  # an end before a start at one instant
            held += change
            most = max(most, held)
    return most


def test_fair_queues_keep_a_flood_from_delaying_the_steady_tenants():
    fcfs, vtc, prefill = run("fcfs"), run("vtc"), run("prefill")
    for row in (fcfs, vtc, prefill):
        assert set(row["tenants"]) == {"a", "b", "noisy"}
        assert row["tenants"]["noisy"]["requests"] > 4 * row["tenants"]["a"]["requests"]
    steady = lambda row: max(row["tenants"][t]["ttft_p99_s"] for t in ("a", "b"))  # noqa: E731
    # first come, first served: the steady tenants wait as long as the flood
    assert steady(fcfs) > 0.8 * fcfs["tenants"]["noisy"]["ttft_p99_s"]
    # fair: the flood waits, they do not (a fifth of FCFS's tail, or better)
    for row in (vtc, prefill):
        assert steady(row) < steady(fcfs) / 5
        assert row["tenants"]["noisy"]["ttft_p99_s"] > 5 * steady(row)
        assert row["jain_fairness"] > fcfs["jain_fairness"] + 0.2
    # the queue's order changes who waits; the fleet caches no worse (the steady
    # tenants, no longer behind the flood, keep their prefixes warm)
    assert prefill["token_hit_rate"] > fcfs["token_hit_rate"] - 0.02


def test_the_reserve_keeps_a_slot_free_for_light_tenants():
    """Two tenants well below their share beside one sending 12 times their requests:
    without slots kept back, a light tenant's request waits for one of the flood's to
    end; with them (the default), it finds one free and does not queue. Each request
    is a new prompt (one turn, no system prompt to share): no replica holds it, so
    none may take it over the cap (router/fair/slots.py), and the reserve alone frees a slot."""
    light = ChatConfig(
        tenants="a=1,b=1,noisy=12",
        session_rate=0.5,
        num_sessions=20,
        num_apps=1,
        system_prompt_tokens=8,
        max_turns=1,
        reply_tokens=600,
    )
    fleet = replace(FLEET, replicas=4)
    reserved, shared = (
        replay_row(
            replay(
                chat_workload(light),
                replace(fleet, fair_reserve_per_replica=reserve),
                "cache_aware",
            )
        )
        for reserve in (2, 0)
    )
    for tenant in ("a", "b"):
        assert reserved["tenants"][tenant]["queue_wait_p99_s"] == 0
        assert shared["tenants"][tenant]["queue_wait_p99_s"] > 0
        assert reserved["tenants"][tenant]["ttft_p99_s"] < shared["tenants"][tenant]["ttft_p99_s"]


def test_a_flood_waits_at_the_router_not_in_the_engines_queue():
    """Engines that run 8 requests at once, a cap (128) the flood never reaches: the
    flood's backlog waited in the engines' first-come-first-served queues, where the
    steady tenants' turns waited behind it. Bounded (4 waiting at most, the gateway's
    default), it waits in the router's fair queue, which serves them first."""
    fleet = replace(FLEET, max_outstanding=128, max_num_seqs=8)
    bounded, unbounded = (
        replay(chat_workload(TENANTS), replace(fleet, max_engine_waiting=w), "cache_aware")
        for w in (4, 0)
    )
    assert max_in_flight(bounded) < fleet.max_outstanding
    waited = [r.dispatched_s - r.arrival_s for r in bounded.records if r.tenant == "noisy"]
    assert max(waited) > 10  # held at the router, below the cap
    steady = lambda result: max(  # noqa: E731
        replay_row(result)["tenants"][t]["ttft_p99_s"] for t in ("a", "b")
    )
    assert steady(bounded) < steady(unbounded) / 2
    # the flood, not they, waited at the router; the fleet cached more
    rows = replay_row(bounded), replay_row(unbounded)
    waits = {t: v["queue_wait_p99_s"] for t, v in rows[0]["tenants"].items()}
    assert max(waits["a"], waits["b"]) < waits["noisy"] / 10
    assert rows[0]["token_hit_rate"] > rows[1]["token_hit_rate"]


def test_without_a_cap_nothing_waits_and_tenants_are_reported():
    config = ReplayConfig(replicas=2, capacity_blocks=2048, host_blocks=0)
    row = replay_row(replay(chat_workload(TENANTS), config, "cache_aware"))
    assert all(t["queue_wait_p99_s"] == 0 for t in row["tenants"].values())
    untenanted = replay_row(replay(chat_workload(ChatConfig(num_sessions=8)), config))
    assert "tenants" not in untenanted


def test_a_batch_tenant_waits_behind_interactive_ones():
    workload = chat_workload(
        ChatConfig(tenants="chat=1,bulk=8:batch", session_rate=0.3, num_sessions=12, num_apps=1)
    )
    row = replay_row(replay(workload, FLEET, "cache_aware"))
    chat, bulk = row["tenants"]["chat"], row["tenants"]["bulk"]
    assert (chat["priority"], bulk["priority"]) == ("interactive", "batch")
    assert chat["queue_wait_p99_s"] < bulk["queue_wait_p99_s"] / 10


def test_max_min_shares_fill_small_demands_first():
    assert max_min_shares([1, 10, 10], 9) == [1, 4, 4]
    assert max_min_shares([1, 2, 3], 100) == [1, 2, 3]
    assert max_min_shares([5, 5], 4) == [2, 2]
    assert jain_fairness([]) is None


@pytest.mark.parametrize("spec", ["a", "a=0", "a=x", "a=1:urgent", "=1"])
def test_bad_tenant_specs_are_named(spec):
    with pytest.raises(ValueError, match="bad tenant"):
        ChatConfig(tenants=spec)


def test_a_tenant_at_its_cache_budget_starts_its_conversations_in_one_place():
    """The flood's new conversations spread over the fleet; with a budget of 5% of each
    replica's blocks, passed everywhere at once, they start where it holds the most, and
    the other replicas keep the steady tenants' prefixes."""

    def new_sessions_per_replica(budgets: str) -> list[int]:
        config = ReplayConfig(
            replicas=4,
            capacity_blocks=2048,
            host_blocks=0,
            compute_scale=0.3,
            cache_budgets=budgets,
        )
        result = replay(chat_workload(TENANTS), config, "cache_aware")
        first_turns = Counter(
            r.replica for r in result.records if r.tenant == "noisy" and not r.turn
        )
        return sorted(first_turns.values(), reverse=True)

    spread, kept = new_sessions_per_replica(""), new_sessions_per_replica("noisy=0.05")
    assert sum(spread) == sum(kept) and spread[0] < 0.6 * sum(spread)
    assert kept[0] > 0.9 * sum(kept)


@pytest.mark.parametrize("spec", ["noisy", "noisy=0", "noisy=1.5", "=0.5", "noisy=x"])
def test_bad_cache_budgets_are_named(spec):
    with pytest.raises(ValueError, match="bad cache budget"):
        ReplayConfig(cache_budgets=spec)


def test_prefill_charging_serves_a_tenant_whose_prompts_are_cached_before_one_whose_are_not():
    """Two tenants sending the same number of equally long prompts to one saturated
    replica: one's open with the same 2,000 tokens (cached after the first), the
    other's are new every time. VTC charges every prompt token, so both wait alike;
    charging the prefill each causes, the tenant whose prompts are cached costs the
    engine little and is served first. (The same test passes for VTC in both runs
    when prefill charging is VTC's: it is what tells them apart.)"""
    shared = np.arange(1, 2_001, dtype=np.int64)

    def own(seed: int, tokens: int) -> np.ndarray:
        return (np.arange(tokens, dtype=np.int64) * 7 + 10_000 * seed) % 120_000 + 3_000

    sessions = []
    for i in range(60):
        reuse = np.concatenate([shared, own(i, 32)])
        fresh = own(1_000 + i, 2_032)
        for name, tokens, start in (("reuse", reuse, 0.05 * i), ("fresh", fresh, 0.05 * i + 0.01)):
            turn = Turn(lambda p=tokens: p, 32)
            sessions.append(Session(f"{name}-{i}", start, (turn,), cache_salt=name, tenant=name))
    workload = Workload("cached-and-fresh", tuple(sessions))
    fleet = ReplayConfig(
        replicas=1, capacity_blocks=4096, host_blocks=0, max_outstanding=2, compute_scale=0.3
    )

    def median_ttft(fairness: str) -> dict[str, float]:
        result = replay(workload, replace(fleet, fairness=fairness), "cache_aware")
        waits: dict[str, list[float]] = {}
        for r in result.records:
            assert r.first_token_s is not None and r.tenant is not None
            waits.setdefault(r.tenant, []).append(r.first_token_s - r.arrival_s)
        return {tenant: float(np.median(w)) for tenant, w in waits.items()}

    vtc, prefill = median_ttft("vtc"), median_ttft("prefill")
    assert vtc["reuse"] == pytest.approx(vtc["fresh"], rel=0.2)  # alike under VTC
    assert prefill["reuse"] < vtc["reuse"] / 2  # served first (5.1 against 15.3 s)
    assert prefill["fresh"] > vtc["fresh"]  # and the other after it
