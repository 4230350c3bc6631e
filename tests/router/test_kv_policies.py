"""Policies that move KV: a peer's prefix pulled where the pull beats computing it and
weighed as such in the choice; P/D policies planning a prefill leg, blind or
cache-aware, conditionally in place."""

import numpy as np

from router.core import ReplicaState
from router.fleet import load
from router.policies import PolicyConfig, make_policy
from tests.router.test_policies import fleet, request
from tests.shared import FakeClock, prompt


def policy(name: str, **config):
    return make_policy(name, FakeClock(), np.random.default_rng(0), PolicyConfig.of(**config))


def busy(replica: ReplicaState, requests: int, prefill_tokens: int = 0) -> None:
    replica.outstanding_requests, replica.outstanding_prefill_tokens = requests, prefill_tokens
    load.changed(replica)


def warm(pol, replicas: list[ReplicaState], tokens: np.ndarray, where: int) -> None:
    """``where`` holds ``tokens`` (the policy learned it from its own decision)."""
    warming = request(tokens, "warm")
    chosen = pol.choose(warming, [replicas[where]])
    load.dispatched(pol, warming, chosen)
    load.completed(pol, warming, chosen)


def test_a_busy_holder_loses_to_an_idle_replica_that_pulls_the_prefix():
    document = prompt(4000)
    for pulls in (False, True):
        pol, replicas = policy("cache_aware", peer_pulls=pulls), fleet(2)
        for replica in replicas:
            pol.on_replica_added(replica)
        warm(pol, replicas, document, where=0)
        busy(replicas[0], requests=6, prefill_tokens=3000)
        asked = request(np.concatenate([document, prompt(40, start=9000)]), "next")
        chosen = pol.choose(asked, replicas)
        if not pulls:  # recomputing 4,000 tokens costs more than the queue: it waits
            assert chosen is replicas[0] and asked.kv is None
            continue
        assert chosen is replicas[1]  # the pull costs a fraction of the queue
        assert asked.kv is not None and asked.kv.pull_from is replicas[0]
        assert asked.kv.pull_tokens == asked.predicted_cached_tokens >= 3968


def test_no_pull_is_planned_where_the_replica_holds_the_prefix_already():
    pol, replicas = policy("cache_aware", peer_pulls=True), fleet(2)
    for replica in replicas:
        pol.on_replica_added(replica)
    warm(pol, replicas, prompt(2000), where=1)
    asked = request(prompt(2000), "again")
    assert pol.choose(asked, replicas) is replicas[1] and asked.kv is None


def pd_fleet() -> list[ReplicaState]:
    replicas = fleet(4)
    for replica, role in zip(replicas, ("prefill", "prefill", "decode", "decode"), strict=True):
        replica.role = role
    return replicas


def test_the_blind_pd_router_takes_the_least_loaded_of_each_pool():
    pol, replicas = policy("pd_blind"), pd_fleet()
    busy(replicas[0], 3)
    busy(replicas[3], 2)
    asked = request(prompt(500))
    assert pol.choose(asked, replicas) is replicas[2]
    assert asked.kv is not None and asked.kv.prefill is replicas[1]


def test_pd_always_prefills_where_the_prompt_is_cached_and_decodes_where_its_history_is():
    pol, replicas = policy("pd_always"), pd_fleet()
    for replica in replicas:
        pol.on_replica_added(replica)
    document = prompt(3000)
    warm(pol, replicas, document, where=1)  # a prefill replica computed it
    warm(pol, replicas, document, where=3)  # a decode replica pulled it
    asked = request(np.concatenate([document, prompt(600, start=7000)]), "turn")
    assert pol.choose(asked, replicas) is replicas[3]
    assert asked.kv is not None and asked.kv.prefill is replicas[1]
    assert asked.predicted_cached_tokens >= 2944  # the prefill replica's hits


def test_pd_conditional_prefills_a_short_suffix_in_place_and_a_long_one_apart():
    pol, replicas = policy("pd_conditional"), pd_fleet()
    for replica in replicas:
        pol.on_replica_added(replica)
    history = prompt(3000)
    warm(pol, replicas, history, where=2)
    for decoder in replicas[2:]:  # decodes running there: a long prefill would stall them
        busy(decoder, requests=8)
    next_turn = request(np.concatenate([history, prompt(100, start=7000)]), "turn")
    assert pol.choose(next_turn, replicas) is replicas[2] and next_turn.kv is None
    document = request(prompt(6000, start=20000), "document")
    chosen = pol.choose(document, replicas)
    assert chosen.role == "decode" and document.kv is not None
    assert document.kv.prefill is not None and document.kv.prefill.role == "prefill"
    quiet = pd_fleet()  # nothing running anywhere: in place is sooner, and stalls nobody
    for replica in quiet:
        pol.on_replica_added(replica)
    alone = request(prompt(6000, start=40000), "alone")
    assert pol.choose(alone, quiet[2:]).role == "decode" and alone.kv is None
