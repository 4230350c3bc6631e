"""The placement experiment's variants (benchmarks/placement_homes.py) do what they say."""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import replace

import pytest

from benchmarks import placement_homes
from benchmarks.placement_homes import VARIANTS
from loadtest.replay import replay
from loadtest.workloads import chat_workload
from router.policies import POLICIES
from tests.router.test_policies import policy
from tests.router.test_saturation import SATURATED, shared_prefix


@pytest.fixture
def variants(monkeypatch):
    for cls in VARIANTS:  # registered for this test only
        monkeypatch.setitem(POLICIES, cls.name, cls)


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


def test_placed_homes_are_cache_aware_with_its_homes_and_eviction_knobs(variants):
    # what the knobs do: tests/router/test_homes.py
    placed, priced = policy("placed_homes").config, policy("placed_homes_priced").config
    assert placed.cache_aware.homes and not placed.cache_aware.eviction_weight
    assert priced.cache_aware.homes and priced.cache_aware.eviction_weight == 16.0
    assert priced.cache_aware.crowded_share == 0  # priced wherever
    default = policy("cache_aware").config.cache_aware  # both on, copies priced where crowded
    assert default.homes and default.eviction_weight == 16.0 and default.crowded_share == 0.3
