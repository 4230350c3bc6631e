"""The placement experiment's variants (benchmarks/placement_homes.py) do what they say."""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import replace

import numpy as np
import pytest

from benchmarks import placement_homes
from benchmarks.placement_homes import VARIANTS, snake
from loadtest.replay import replay
from loadtest.workloads import chat_workload
from replica.api.stats import LoadReport
from router.fleet import load
from router.policies import POLICIES
from tests.router.test_policies import complete, dispatch, fleet, policy, request
from tests.router.test_saturation import SATURATED, shared_prefix
from tests.shared import prompt


@pytest.fixture
def variants(monkeypatch):
    for cls in VARIANTS:  # registered for this test only
        monkeypatch.setitem(POLICIES, cls.name, cls)


def test_homes_are_given_in_a_snake_so_the_first_and_most_popular_groups_spread():
    assert [snake(i, 4) for i in range(10)] == [0, 1, 2, 3, 3, 2, 1, 0, 0, 1]


def test_register_adds_the_variants_by_name(monkeypatch):
    monkeypatch.setattr(placement_homes, "POLICIES", registry := dict(POLICIES))
    placement_homes.register()
    assert {"static_partition", "homes_in_turn", "placed_homes"} <= registry.keys()


def test_a_static_partition_keeps_every_group_on_its_home_and_the_homes_even(variants):
    workload = chat_workload(shared_prefix(8.0))  # the KV-short fleet at twice its rate
    app = [session.app for session in workload.sessions]
    result = replay(workload, replace(SATURATED, seed=0), "static_partition")
    replicas: dict[int, set[int]] = defaultdict(set)
    for record in result.records:
        replicas[app[record.session]].add(record.replica)
    assert all(len(held) == 1 for held in replicas.values())
    assert sorted(Counter(next(iter(held)) for held in replicas.values()).values()) == [6] * 4


def prompts(count: int, length: int = 2048) -> list[np.ndarray]:
    return [prompt(length, start=1 + i * 100_000) for i in range(count)]


def test_placed_homes_are_given_in_a_snake_and_a_prompt_evicted_everywhere_goes_home(
    variants,
):
    pol, replicas = policy("placed_homes"), fleet(4)
    homes = []
    for i, group in enumerate(prompts(8)):
        new = request(group, f"new-{i}")
        homes.append(chosen := dispatch(pol, new, replicas))
        complete(pol, new, chosen)
    assert [r.replica_id for r in homes] == [f"replica-{i}" for i in (0, 1, 2, 3, 3, 2, 1, 0)]
    pol.clock.now += 3600  # the index forgets every group; the homes do not
    load.reported(replicas[0], LoadReport(running=64, waiting=0, prefill_tokens=40_000))
    again = request(prompts(1)[0], "again")
    assert pol.choose(again, replicas).replica_id == "replica-0"  # home, busy as it is
    assert policy("cache_aware").choose(again, replicas).replica_id != "replica-0"


def test_placed_homes_priced_charges_a_copy_for_the_hot_prefixes_it_would_evict(variants):
    pol, replicas = policy("placed_homes_priced"), fleet(2, capacity=256)  # 4,096 tokens
    hot = prompt(3072)
    for turn in range(2):  # shared by two requests: hot on replica-0
        pol.on_dispatch(request(hot, f"hot-{turn}"), replicas[0])
    new = request(prompt(1024, start=500_000), "new")
    pol.choose(new, replicas)
    # 3,072 hot + 1,024 new tokens pass 60% of 4,096 by 1,638: all 1,024 priced, x16
    assert pol._unseen_by_load(replicas[0], 1024) == 16 * 1024
    assert pol._unseen_by_load(replicas[1], 1024) == 0  # nothing hot there
    pol.on_dispatch(request(prompt(8), "short"), replicas[1])  # under a stride: not hot
    assert pol._unseen_by_load(replicas[1], 1024) == 0
