"""The fleet's size: Ray Serve's rule on a prefix-cached fleet's signals, and which
replica a scale-in stops."""

from __future__ import annotations

import numpy as np
import pytest

from router.fleet.autoscaler import AutoscaleConfig, Autoscaler, FleetLoad, to_stop
from tests.router.test_policies import dispatch, fleet, policy, request
from tests.shared import FakeClock, prompt

CONFIG = AutoscaleConfig(
    min_replicas=2,
    max_replicas=6,
    target_ongoing_requests=10,
    target_queued_prefill_tokens=1_000,
    upscale_delay_s=5,
    downscale_delay_s=30,
)


def test_the_fleet_wants_what_either_signal_needs_within_the_bounds():
    scaler = Autoscaler(CONFIG, FakeClock())
    assert scaler.wanted(FleetLoad(0, 0)) == 2  # the floor
    assert scaler.wanted(FleetLoad(31, 0)) == 4  # 31 requests at 10 a replica
    assert scaler.wanted(FleetLoad(5, 3_500)) == 4  # 3,500 tokens waiting at 1,000
    assert scaler.wanted(FleetLoad(500, 0)) == 6  # the ceiling


def test_each_pool_of_a_disaggregated_fleet_is_sized_by_its_own_signal():
    clock = FakeClock()
    prefill, decode = Autoscaler(CONFIG, clock, "prefill"), Autoscaler(CONFIG, clock, "decode")
    many_decodes, prompts_waiting = FleetLoad(31, 0), FleetLoad(5, 3_500)
    assert (prefill.wanted(many_decodes), decode.wanted(many_decodes)) == (2, 4)
    assert decode.wanted(prompts_waiting) == 4  # prefilled in place: its work too
    by_requests = AutoscaleConfig(
        max_replicas=6, target_ongoing_requests=10, target_queued_prefill_tokens=0
    )
    assert Autoscaler(by_requests, clock, "prefill").wanted(many_decodes) == 4
    with pytest.raises(ValueError, match="role"):
        Autoscaler(CONFIG, clock, "encode")


def test_growth_waits_for_its_delay_and_a_shrink_goes_one_replica_at_a_time():
    clock = FakeClock()
    scaler = Autoscaler(CONFIG, clock)
    busy, idle = FleetLoad(55, 0), FleetLoad(0, 0)
    assert scaler.decide(2, busy) == 2  # the wish starts
    clock.now += 4
    assert scaler.decide(2, busy) == 2
    clock.now += 1
    assert scaler.decide(2, busy) == 6  # held for 5 s: in one go
    # a dip shorter than the down delay changes nothing, and restarts its count
    clock.now += 20
    assert scaler.decide(6, idle) == 6
    clock.now += 20
    assert scaler.decide(6, busy) == 6
    clock.now += 20
    assert scaler.decide(6, idle) == 6
    clock.now += 29
    assert scaler.decide(6, idle) == 6
    clock.now += 1
    assert scaler.decide(6, idle) == 5  # held for 30 s: one replica goes
    assert scaler.decide(5, idle) == 5  # and the next waits its own 30 s
    clock.now += 30
    assert scaler.decide(5, idle) == 4


@pytest.mark.parametrize(
    "bad",
    [
        {"min_replicas": 0},
        {"min_replicas": 3, "max_replicas": 2},
        {"target_ongoing_requests": 0},
        {"upscale_delay_s": -1},
        {"scale_in": "oldest"},
    ],
)
def test_bad_configs_are_named(bad):
    with pytest.raises(ValueError, match=next(iter(bad)).split("_")[0]):
        AutoscaleConfig(**{"max_replicas": 4, **bad})


def test_a_cache_aware_scale_in_stops_the_replica_whose_prefixes_others_hold():
    """Three replicas: a hot prompt cached on 0 and 1, a cold one on 2 only. The load
    rule stops the idlest (2, taking the only copy of its prompt); the cache rule stops
    one whose prompt survives elsewhere."""
    pol, replicas = policy("cache_aware"), fleet(3)
    for replica in replicas:
        pol.on_replica_added(replica)
    hot, cold = prompt(512), prompt(512, start=10_000)
    for index, tokens in ((0, hot), (1, hot), (2, cold)):
        dispatch(pol, request(tokens), [replicas[index]])  # the index learns who holds what
    for _ in range(20):  # the hot prompt is asked for often
        dispatch(pol, request(hot), replicas[:2])
    ids = [r.replica_id for r in replicas]
    load = {"replica-0": 3, "replica-1": 2, "replica-2": 0}
    rng = np.random.default_rng(0)
    assert pol.cache_value("replica-2") > 0
    assert pol.cache_value("replica-0") == pol.cache_value("replica-1") == 0
    assert to_stop("load", ids, load, pol.cache_value, rng) == "replica-2"
    assert to_stop("cache", ids, load, pol.cache_value, rng) == "replica-1"
    assert {to_stop("random", ids, load, pol.cache_value, rng) for _ in range(30)} == set(ids)
    assert policy("round_robin").cache_value("replica-0") == 0
