"""``cache_aware`` over a whole fleet prices only the replicas that hold part of the
prompt and the cheapest cold ones (``router/policies/load_order.py``), and, where copies
pay for the hot prefixes they evict (``eviction_weight``), the cold ones whose load
leaves room under the best: on random fleets, loads, hot sets and prompts it picks a
replica of the least cost that pricing every replica finds, indeed the very replica
the full scan picks (ties break alike), and the scan's choice for a cold prefix (by
rendezvous, or its home)."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from replica.api.identity import DEFAULT_MODEL, identity_seed, prefix_keys
from replica.api.stats import LoadReport
from router.core import ReplicaState, RoutingRequest
from router.fleet import load
from router.policies import PolicyConfig, make_policy
from tests.shared import FakeClock, prompt

SEED = identity_seed(DEFAULT_MODEL)
BLOCK, STRIDE = 16, 4
BASES = [prompt(3000, 100_000 * b) for b in range(4)]
#: Today's price; copies that pay for what they evict (on fleets of 4,096-block replicas
#: a hot set passes the fill of 0.01 at once); and homes for prefixes cached nowhere.
KNOBS = [
    {},
    {"eviction_weight": 16.0, "hot_fill": 0.01},
    {"homes": True, "eviction_weight": 4.0, "hot_fill": 0.01},
]


def keys(tokens: np.ndarray) -> list[int]:
    return prefix_keys(tokens, BLOCK, STRIDE, SEED)


def scan_costs(policy, request: RoutingRequest, fleet: list[ReplicaState]) -> list[float]:
    """Every replica priced, as the policy's full scan prices it."""
    matched = policy._matches(request, fleet)
    host = policy._host_matches(request, matched)
    popular = policy.popular_tokens(request)
    load_of = policy._load_function(sum(r.load_requests for r in fleet), len(fleet))
    prompt_tokens = request.num_prompt_tokens
    costs = []
    for replica in fleet:
        gpu, more = matched.get(replica.replica_id, 0), host.get(replica.replica_id, 0)
        work = (
            policy._held_cost(prompt_tokens, popular, gpu, more)
            if replica.replica_id in matched or replica.replica_id in host
            else policy._recompute_cost(prompt_tokens, popular, 0)
        )
        evicts = policy._eviction_cost(replica, prompt_tokens - gpu - more)
        costs.append(load_of(replica.load_prefill_tokens, replica.load_requests) + work + evicts)
    return costs


@st.composite
def scenes(draw):
    size = draw(st.integers(1, 300))
    seed = draw(st.integers(0, 2**32 - 1))
    knobs = draw(st.sampled_from(KNOBS))
    rng = np.random.default_rng(seed)
    policy = make_policy("cache_aware", FakeClock(), rng, PolicyConfig.of(**knobs))
    fleet = [ReplicaState(f"r{i}", 4096) for i in range(size)]
    for replica in fleet:
        policy.on_replica_added(replica)
        busy = draw(st.sampled_from(["idle", "light", "heavy"]))
        replica.outstanding_requests = 0 if busy == "idle" else int(rng.integers(0, 40))
        replica.outstanding_prefill_tokens = (
            0 if busy == "idle" else int(rng.integers(0, 3)) * 4096 * (busy == "heavy")
        )  # many equal loads: ties matter
        load.changed(replica)
    for _ in range(draw(st.integers(0, 30))):  # prefixes of four prompts, here and there
        tokens = BASES[int(rng.integers(4))][: int(rng.integers(64, 3000))]
        owner = fleet[int(rng.integers(size))]
        bit = policy.index._bits[owner.replica_id]
        target = policy.index.host if rng.random() < 0.3 else policy.index.stored
        target.add(bit, keys(tokens))
        for _ in range(int(rng.integers(0, 20))):
            policy.popularity.record(keys(tokens))
        if policy.hot_prefixes is not None:  # hot there: a copy evicting it pays
            hot = keys(tokens)
            policy.hot_prefixes.routed(owner.replica_id, hot[-1], len(hot) * BLOCK * STRIDE)
    return policy, fleet, rng


@settings(max_examples=150, deadline=None)
@given(scenes(), st.integers(0, 3), st.integers(64, 3000))
def test_the_fleet_path_picks_a_replica_of_the_least_cost(scene, base, length):
    policy, fleet, _ = scene
    request = RoutingRequest("q", length, keys(BASES[base][:length]))
    dice = policy.ties.state
    chosen = policy.choose(request, fleet)
    matched = policy._matches(request, fleet)
    host = policy._host_matches(request, matched)
    if matched or host:
        costs = scan_costs(policy, request, fleet)
        assert costs[fleet.index(chosen)] == min(costs)
    # The very replica of the scan, ties included (the same draw breaks them).
    policy.ties.state = dice
    popular = policy.popular_tokens(request)
    assert chosen is policy._choose_by_scan(request, fleet, matched, host, popular)


@settings(max_examples=100, deadline=None)
@given(scenes(), st.integers(1, 3000))
def test_a_cold_prefix_goes_where_the_scan_sends_it(scene, length):
    policy, fleet, _ = scene
    cold = prompt(length, 7_000_000)
    request = RoutingRequest("cold", length, keys(cold))
    fast = policy.choose(request, fleet)
    assert fast is policy._choose_by_scan(request, fleet, {}, {}, 0)
    assert request.predicted_cached_tokens == 0


def test_the_order_follows_every_load_change_the_router_makes():
    rng = np.random.default_rng(3)
    policy = make_policy("cache_aware", FakeClock(), rng, PolicyConfig())
    fleet = [ReplicaState(f"r{i}", 4096) for i in range(20)]
    for replica in fleet:
        policy.on_replica_added(replica)
    in_flight: list[tuple[RoutingRequest, ReplicaState]] = []
    for step in range(2000):
        action = rng.random()
        if action < 0.5 or not in_flight:
            request = RoutingRequest(f"q{step}", int(rng.integers(1, 4000)))
            replica = policy.choose(request, fleet)
            load.dispatched(policy, request, replica, now=float(step))
            in_flight.append((request, replica))
        elif action < 0.7:
            load.prefilled(*in_flight[int(rng.integers(len(in_flight)))])
        elif action < 0.95:
            request, replica = in_flight.pop(int(rng.integers(len(in_flight))))
            load.completed(policy, request, replica)
        else:  # another gateway's view of one replica
            replica = fleet[int(rng.integers(20))]
            report = LoadReport(int(rng.integers(0, 9)), 0, int(rng.integers(0, 5000)), ts=step)
            load.reported(replica, report)
        filed = policy.order._filed
        assert all(filed[r.replica_id] == (r.load_requests, r.load_prefill_tokens) for r in fleet)
        assert policy.order.total_requests == sum(r.load_requests for r in fleet)
    policy.on_replica_removed(fleet[0])
    assert len(policy.order) == 19 and fleet[0].on_load_change is None
