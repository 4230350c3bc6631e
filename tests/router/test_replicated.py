"""Hot prefixes spread on purpose: a replication set per hot prefix, sized by its share
of the requests, its members chosen alike by every router."""

from __future__ import annotations

import numpy as np
import pytest

from router.core import ReplicaState, RoutingRequest
from router.fleet import load
from router.policies.replicated import CacheAwareReplicated, HotSets
from tests.router.test_policies import fleet, policy, request
from tests.shared import FakeClock, prompt


def test_a_set_grows_with_its_share_at_once_and_shrinks_with_a_margin():
    clock = FakeClock()
    hot = HotSets(clock, half_life_s=10, headroom=1.0)
    for i in range(100):  # 60% of the requests through prefix 7
        hot.record(7 if i % 5 < 3 else None)
    assert hot.share(7) == pytest.approx(0.6)
    assert hot.size(7, 8) == 5  # 4.8 replicas' worth of traffic
    assert hot.size(7, 8) == 5 and hot.sizes() == {7: 5}
    for _ in range(20):  # its share falls to 0.5: 4 replicas' worth, within the margin
        hot.record(None)
    assert hot.share(7) * 8 == pytest.approx(4) and hot.size(7, 8) == 5
    for _ in range(40):  # 0.375: 3 replicas' worth
        hot.record(None)
    assert hot.share(7) * 8 == pytest.approx(3) and hot.size(7, 8) == 3
    assert [size for _, key, size in hot.changes if key == 7] == [5, 3]
    clock.now += 200  # twenty half-lives without it: forgotten at the next sweep
    hot.record(None)
    assert hot.share(7) == 0 and hot.sizes() == {} and hot.changes[-1][1:] == (7, 1)


def route(pol: CacheAwareReplicated, req: RoutingRequest, replicas: list[ReplicaState]) -> str:
    """Choose, dispatch and complete at once: the fleet stays idle, so the choice is
    the prices of what is held (ties at random)."""
    chosen = pol.choose(req, replicas)
    load.dispatched(pol, req, chosen)
    load.completed(pol, req, chosen)
    return chosen.replica_id


def traffic(
    pol: CacheAwareReplicated, replicas: list[ReplicaState], n: int, seed: int = 1
) -> list[str]:
    """60% of the requests on one 1,024-token system prompt, each with its own question
    after it; the rest on prompts of their own (``seed``: which, and in what order).
    Where each hot request went."""
    rng = np.random.default_rng(seed)
    went = []
    for i in range(n):
        own = int(rng.integers(0, 2**20))  # this router's traffic, not another's
        if rng.random() < 0.6:
            tokens = np.concatenate([prompt(1_024), prompt(64, start=100_000 + 64 * own)])
            went.append(route(pol, request(tokens, f"hot-{i}"), replicas))
        else:
            cold = prompt(1_088, start=1_000_000 + 2_000 * own)
            route(pol, request(cold, f"cold-{i}"), replicas)
    return went


def test_a_hot_prompt_spreads_over_its_set_and_every_router_picks_the_same_one():
    replicas = fleet(8)
    pol = policy("cache_aware_replicated")
    for replica in replicas:
        pol.on_replica_added(replica)
    went = traffic(pol, replicas, 300)
    (hot_set,) = pol.hot_sets()
    assert 0.5 < hot_set.share < 0.7 and len(hot_set.replicas) == 5
    late = set(went[-100:])  # once the set stands, the hot prompt goes only to its members
    assert late <= set(hot_set.replicas) and len(late) >= 4
    # Two other routers, each fed traffic of its own (other questions, other cold
    # prompts, another order, 200 and 400 requests): the same members, whatever each
    # saw, the smaller set the first members of the larger.
    for seed, requests in ((2, 200), (3, 400)):
        other = policy("cache_aware_replicated", seed=seed)
        own_fleet = fleet(8)
        for replica in own_fleet:
            other.on_replica_added(replica)
        went_there = traffic(other, own_fleet, requests, seed=seed)
        (its_set,) = other.hot_sets()
        shared = min(len(its_set.replicas), len(hot_set.replicas))
        assert shared >= 4 and its_set.replicas[:shared] == hot_set.replicas[:shared]
        assert set(went_there[-50:]) <= set(its_set.replicas)
    # a member leaving: the set is made of the others, the rest of it unmoved
    gone = hot_set.replicas[0]
    pol.on_replica_removed(replicas[int(gone.rsplit("-", 1)[1])])
    now = [r.replica_id for r in pol.members(hot_set.key)]
    assert gone not in now and now[:4] == list(hot_set.replicas[1:])
    # the sets as the Policy protocol tells them: a prompt's popular part spreads
    # over its set, and a policy that does not replicate keeps no sets
    hot_prompt = request(np.concatenate([prompt(1_024), prompt(64, start=7)]), "hot").stride_hashes
    assert pol.spread_over(hot_prompt) == list(pol.hot_sets()[0].replicas)
    plain = policy("cache_aware")
    assert plain.hot_sets() == [] and plain.spread_over(hot_prompt) == []
