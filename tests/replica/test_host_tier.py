"""The engine with a host tier: evicted prefixes come back over PCIe when that is cheaper."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loadtest.workloads import load_workload
from replica.api.config import ReplicaConfig
from replica.engine import Engine, EngineConfig, EngineRequest
from tests.replica.test_engine import run
from tests.shared import MOONCAKE_TRACE, Colliding, prompt


def engine_with(num_blocks: int, host_blocks: int, **config) -> Engine:
    return Engine(EngineConfig(num_blocks=num_blocks, host_blocks=host_blocks, **config))


def evict_then_reuse(engine: Engine, length: int, salt: str | None = None) -> dict:
    """Compute a prompt, push it off the GPU with another as long, then send it again."""
    system = prompt(length, 1)
    run(engine, [EngineRequest("first", system, 1, ignore_eos=True)])
    whole_pool = engine.config.capacity_tokens - 1  # with its one output token: every block
    run(engine, [EngineRequest("filler", prompt(whole_pool, 10**6), 1, ignore_eos=True)])
    again = EngineRequest("again", system, 1, ignore_eos=True, cache_salt=salt)
    return run(engine, [again])["again"]


def blocks_for(length: int) -> int:
    return -(-length // 16) + 2


def test_a_long_prefix_evicted_to_the_host_is_loaded_back_and_cuts_ttft():
    length = 4096
    with_host = engine_with(blocks_for(length), host_blocks=1024)
    without = engine_with(blocks_for(length), host_blocks=0)
    loaded, recomputed = evict_then_reuse(with_host, length), evict_then_reuse(without, length)
    assert loaded["cached"] == length - 16 and recomputed["cached"] == 0
    assert loaded["ttft"] < recomputed["ttft"] / 4  # a copy over PCIe, not 4k tokens of prefill
    stats = with_host.cache_stats
    assert stats.host_hit_tokens == length - 16 and stats.hit_tokens == length - 16
    assert with_host.bytes_to_gpu == (length - 16) // 16 * with_host.block_bytes
    assert with_host.bytes_to_host >= with_host.bytes_to_gpu
    with_host.cache.check_invariants()
    assert with_host.host is not None
    with_host.host.check_invariants()


@pytest.mark.parametrize("length", [32, 64, 128, 256, 512, 1024, 2048, 8192])
@pytest.mark.parametrize("profile", ["llama3-8b-h100", "llama3-8b-a100", "llama3-70b-4xh100"])
def test_a_host_hit_is_never_slower_than_recomputing(profile, length):
    """The engine loads only where the model says a load is cheaper, so the host tier
    never makes a request slower; where it loads, the request is faster."""
    with_host = engine_with(blocks_for(length), host_blocks=1024, profile=profile)
    without = engine_with(blocks_for(length), host_blocks=0, profile=profile)
    loaded, recomputed = evict_then_reuse(with_host, length), evict_then_reuse(without, length)
    host_tokens = (length - 1) // 16 * 16
    should_load = with_host.cost.load_beats_recompute(host_tokens, 0, length - host_tokens)
    assert (with_host.cache_stats.host_hit_tokens > 0) == should_load
    assert loaded["tokens"] == recomputed["tokens"]  # the same answer either way
    if should_load:
        assert loaded["ttft"] < recomputed["ttft"]
    else:
        assert loaded["ttft"] == pytest.approx(recomputed["ttft"], rel=1e-9)


def test_the_crossover_lies_between_short_and_long_prompts():
    cost = engine_with(64, 0).cost
    assert not cost.load_beats_recompute(32, 0, 16)  # hides under the weight read
    assert cost.load_beats_recompute(4096, 0, 16)  # thousands of tokens of prefill


def test_tenants_never_hit_each_others_host_blocks():
    engine = engine_with(blocks_for(2048), host_blocks=1024)
    other_tenant = evict_then_reuse(engine, 2048, salt="globex")
    assert other_tenant["cached"] == 0 and engine.cache_stats.host_hit_tokens == 0


def test_a_hash_collision_on_the_host_costs_a_miss_not_a_wrong_answer():
    config = EngineConfig(num_blocks=blocks_for(1024), host_blocks=512)
    engine = Engine(config, hasher_factory=Colliding)
    reference = Engine(EngineConfig(num_blocks=4096))
    first = prompt(1024, 1)
    run(engine, [EngineRequest("a", first, 1, ignore_eos=True)])
    run(engine, [EngineRequest("b", prompt(1024, 5000), 1, ignore_eos=True)])  # demotes a
    other = prompt(1024, 9000)  # collides with both on every block
    got = run(engine, [EngineRequest("c", other, 4, ignore_eos=True)])["c"]
    expected = run(reference, [EngineRequest("c", other, 4, ignore_eos=True)])["c"]
    assert got["cached"] == 0 and engine.cache_stats.host_hit_tokens == 0
    assert got["tokens"] == expected["tokens"]
    assert np.array_equal(first, prompt(1024, 1))  # nothing was overwritten either


def test_reset_empties_both_tiers():
    engine = engine_with(blocks_for(1024), host_blocks=512)
    evict_then_reuse(engine, 1024)
    assert engine.host is not None and len(engine.host) > 0
    assert engine.reset_cache()
    assert len(engine.host) == 0 and engine.cache.num_cached_blocks == 0
    events, _ = engine.cache.events_since(0)
    assert {e.medium for e in events} == {"GPU", "CPU"} and events[-1].kind == "cleared"


@settings(max_examples=60, deadline=None)
@given(
    host_blocks=st.integers(1, 48),
    documents=st.lists(st.tuples(st.integers(0, 5), st.integers(0, 5)), min_size=4, max_size=30),
)
def test_random_traffic_through_two_small_tiers_keeps_every_invariant(host_blocks, documents):
    """Two requests at a time over a few long documents: loads, demotions into a full
    host and evictions interleave; every answer matches an engine without the tier."""
    engine = engine_with(64, host_blocks=host_blocks)
    reference = engine_with(64, host_blocks=0)
    for turn, pair in enumerate(documents):
        requests = [
            EngineRequest(
                f"r{turn}-{k}",
                np.concatenate((prompt(400, 1 + doc * 10_000), prompt(8 + turn, 10**6 + turn))),
                2,
                ignore_eos=True,
            )
            for k, doc in enumerate(pair)
        ]
        got, expected = run(engine, requests), run(reference, requests)
        assert [r["tokens"] for r in got.values()] == [r["tokens"] for r in expected.values()]
        engine.cache.check_invariants()
        assert engine.host is not None
        engine.host.check_invariants()
    assert engine.cache.usage == 0.0


def test_default_capacities_follow_the_hardware_and_hold_every_mooncake_prompt():
    config = EngineConfig.for_replica(ReplicaConfig())
    assert (config.num_blocks, config.host_blocks) == (26_674, 122_070)  # one H100, 256 GB
    seventy = EngineConfig.for_replica(ReplicaConfig(profile="llama3-70b-4xh100"))
    assert seventy.num_blocks == 28_018 and seventy.host_blocks == 4 * 256e9 // (320 * 1024 * 16)
    workload = load_workload(f"trace:{MOONCAKE_TRACE}", {})
    longest = max(
        len(t.prompt_token_ids) + t.max_tokens for s in workload.sessions for t in s.turns
    )
    assert longest > 4096 * 16  # the old default of 4,096 blocks refused it with a 400
    assert longest <= config.capacity_tokens
    assert EngineConfig.for_replica(ReplicaConfig(host_blocks=0)).host_blocks == 0


def test_the_link_is_named_or_given_as_a_bandwidth():
    fast = engine_with(64, host_blocks=64, host_link="200")
    slow = engine_with(64, host_blocks=64, host_link="pcie4")
    assert fast.link.bytes_per_s == 200e9 and slow.link.bytes_per_s == 25e9
    assert fast.cost.load_time(4096, 1, fast.link) < slow.cost.load_time(4096, 1, slow.link)
    with pytest.raises(ValueError, match="unknown host link 'usb2'"):
        engine_with(64, host_blocks=64, host_link="usb2")
