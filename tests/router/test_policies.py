"""Routing policies: baselines, SGLang's cache_aware, and ours, on small scenes."""

from collections import Counter

import numpy as np
import pytest

from replica.api.identity import DEFAULT_MODEL, block_hashes, identity_seed, prefix_keys
from replica.api.kv_events import KVEvent
from router.core import ReplicaState, RoutingRequest
from router.fleet import load
from router.policies import POLICIES, PolicyConfig, make_policy
from tests.shared import FakeClock, prompt

SEED = identity_seed(DEFAULT_MODEL)
BLOCK, STRIDE = 16, 4


def request(tokens: np.ndarray, request_id: str = "r") -> RoutingRequest:
    return RoutingRequest(request_id, len(tokens), prefix_keys(tokens, BLOCK, STRIDE, SEED))


def fleet(n: int = 4, capacity: int = 4096) -> list[ReplicaState]:
    return [ReplicaState(f"replica-{i}", capacity) for i in range(n)]


def policy(name: str, seed: int = 0, **config):
    made = make_policy(name, FakeClock(), np.random.default_rng(seed), PolicyConfig.of(**config))
    return made


def dispatch(pol, req: RoutingRequest, replicas: list[ReplicaState]) -> ReplicaState:
    """What the router does: choose, count the load, tell the policy."""
    chosen = pol.choose(req, replicas)
    load.dispatched(pol, req, chosen)
    return chosen


def complete(pol, req: RoutingRequest, replica: ReplicaState) -> None:
    load.completed(pol, req, replica)


def test_every_policy_is_registered_by_name():
    assert set(POLICIES) >= {
        "round_robin",
        "random",
        "least_loaded",
        "power_of_two",
        "consistent_hash",
        "sglang_cache_aware",
        "cache_aware",
        "cache_aware_approx",
        "cache_aware_tier_blind",
        "cache_aware_ttft",
    }
    with pytest.raises(ValueError, match="unknown policy"):
        policy("fastest")


def test_round_robin_takes_each_replica_in_turn():
    replicas, pol = fleet(3), policy("round_robin")
    chosen = [pol.choose(request(prompt(10)), replicas).replica_id for _ in range(6)]
    assert chosen == ["replica-0", "replica-1", "replica-2"] * 2


def test_random_is_reproducible_for_a_seed_and_uses_every_replica():
    replicas = fleet(4)
    first, again = policy("random", 7), policy("random", 7)
    draws = [first.choose(request(prompt(5)), replicas).replica_id for _ in range(200)]
    assert draws == [again.choose(request(prompt(5)), replicas).replica_id for _ in range(200)]
    other = policy("random", 8)
    assert draws != [other.choose(request(prompt(5)), replicas).replica_id for _ in range(200)]
    pol = policy("random", 1)
    assert len({pol.choose(request(prompt(5)), replicas).replica_id for _ in range(100)}) == 4


def test_least_loaded_and_power_of_two_avoid_the_busy_replica():
    replicas = fleet(4)
    for replica, held in zip(replicas, (5, 0, 3, 9), strict=True):
        replica.outstanding_requests = held
    assert policy("least_loaded").choose(request(prompt(5)), replicas).replica_id == "replica-1"
    pol = policy("power_of_two", 3)
    picks = Counter(pol.choose(request(prompt(5)), replicas).replica_id for _ in range(300))
    assert picks["replica-3"] == 0  # the busiest never wins a pair
    assert picks["replica-1"] > picks["replica-0"]


def test_consistent_hash_is_sticky_and_moves_only_the_removed_replicas_keys():
    replicas, pol = fleet(4), policy("consistent_hash")
    prompts = [prompt(100, 1000 * i) for i in range(200)]
    before = {i: pol.choose(request(p), replicas).replica_id for i, p in enumerate(prompts)}
    assert len(set(before.values())) == 4
    survivors = [r for r in replicas if r.replica_id != "replica-2"]
    after = {i: pol.choose(request(p), survivors).replica_id for i, p in enumerate(prompts)}
    moved = [i for i in before if before[i] != after[i]]
    assert moved and all(before[i] == "replica-2" for i in moved)


def test_cache_aware_sends_a_cold_prefix_where_independent_routers_agree():
    replicas = fleet(4)
    first, second = policy("cache_aware", 1), policy("cache_aware", 2)
    for i in range(20):
        cold = request(prompt(300, 10_000 * i))
        assert first.choose(cold, replicas) is second.choose(cold, replicas)
        assert cold.predicted_cached_tokens == 0


@pytest.mark.parametrize("name", ["cache_aware", "cache_aware_ttft"])
def test_a_cold_prefix_goes_where_it_evicts_least_and_routers_reading_the_events_agree(name):
    """A replica whose GPU is full evicts a prefix to compute a new one; one with room
    does not. Among those with room (or, all full, among all) the rendezvous choice."""
    replicas = fleet(3, capacity=160)  # 160 blocks: 2,560 tokens each
    first, second = policy(name, 1, homes=False), policy(name, 2, homes=False)  # no homes
    for pol in (first, second):
        for replica in replicas:
            pol.on_replica_added(replica)
        pol.on_kv_events(replicas[0], held_events(prompt(2560, 500_000), "GPU"))  # full
        pol.on_kv_events(replicas[1], held_events(prompt(1024, 600_000), "GPU"))  # room
        pol.on_kv_events(replicas[2], held_events(prompt(2304, 700_000), "GPU"))  # 16 free
    placed = set()
    for i in range(20):
        cold = request(prompt(300, 10_000 * i))  # 19 blocks: only replica-1 has room
        chosen = first.choose(cold, replicas)
        assert chosen is second.choose(cold, replicas) is replicas[1]
        placed.add(first.choose(request(prompt(200, 10_000 * i)), replicas).replica_id)
    assert placed == {"replica-1", "replica-2"}  # 13 blocks: two with room, by rendezvous


def test_cache_aware_follows_a_cached_prefix():
    replicas, pol = fleet(4), policy("cache_aware")
    history = prompt(2000)
    home = dispatch(pol, request(history, "turn-1"), replicas)
    complete(pol, request(history, "turn-1"), home)
    follow_up = request(np.concatenate((history, prompt(100, 99_000))), "turn-2")
    assert pol.choose(follow_up, replicas) is home
    assert follow_up.predicted_cached_tokens == 1984  # whole strides of the history


def test_cache_aware_never_pins_a_hot_shared_prompt_while_others_idle():
    replicas, pol = fleet(4), policy("cache_aware")
    system = prompt(1500)
    homes = Counter()
    for i in range(120):  # 120 concurrent sessions open with the same system prompt
        req = request(np.concatenate((system, prompt(50, 100_000 + 100 * i))), f"s{i}")
        homes[dispatch(pol, req, replicas).replica_id] += 1
        if i == 29:  # the first replica's queue soon outweighs copying the prompt elsewhere
            assert len(homes) > 1
    assert len(homes) == 4 and max(homes.values()) <= 1.5 * min(homes.values())


def test_cache_aware_keeps_affinity_for_long_prefixes_when_a_replica_is_busy():
    replicas, pol = fleet(2), policy("cache_aware")
    long_history, short_history = prompt(8000), prompt(300, 50_000)
    for req in (request(long_history, "long"), request(short_history, "short")):
        chosen = pol.choose(req, [replicas[0]])  # both cached on replica-0
        pol.on_dispatch(req, chosen)
    replicas[0].outstanding_requests, replicas[1].outstanding_requests = 6, 3  # within bound
    replicas[0].outstanding_prefill_tokens = 5000  # busy, but not 8,000 tokens busy
    stay = pol.choose(request(np.concatenate((long_history, prompt(40, 7))), "l2"), replicas)
    move = pol.choose(request(np.concatenate((short_history, prompt(40, 7))), "s2"), replicas)
    assert stay.replica_id == "replica-0" and move.replica_id == "replica-1"


def test_cache_aware_moves_short_histories_off_a_replica_over_its_load_bound():
    replicas, pol = fleet(2), policy("cache_aware")
    short, long = prompt(300), prompt(8000, 50_000)
    for history in (short, long):
        pol.on_dispatch(request(history), replicas[0])  # both cached on replica-0
    home, other = replicas
    short_turn = request(np.concatenate((short, prompt(40, 7))), "short-2")
    long_turn = request(np.concatenate((long, prompt(40, 7))), "long-2")
    home.outstanding_requests = 2  # under the bound, 1.5 x the mean (2 + 1) / 2
    assert pol.choose(short_turn, replicas) is home
    # Far over it (7 against a cap of 5.25), a short history is cheaper to recompute
    # elsewhere; a long one still is not.
    home.outstanding_requests = 6
    assert pol.choose(short_turn, replicas) is other
    assert pol.choose(long_turn, replicas) is home


def test_a_popular_prefix_is_cheap_to_copy_so_new_sessions_spread():
    replicas, pol = fleet(2), policy("cache_aware")
    system = prompt(1500)
    for i in range(20):  # the app's prompt is popular, cached on replica-0 only
        req = request(np.concatenate((system, prompt(50, 1000 + 100 * i))), f"s{i}")
        pol.on_dispatch(req, pol.choose(req, replicas[:1]))
    home, other = replicas
    home.outstanding_requests = 8  # others idle
    # Copying the popular prompt (1,472 tokens x 4) costs less than 8 requests' work...
    new_session = request(np.concatenate((system, prompt(50, 99_000))), "new")
    assert pol.choose(new_session, replicas) is other
    # ...moving a conversation's own history of the same length (x 16) does not.
    history = prompt(1550, 77_000)
    pol.on_dispatch(request(history, "private"), home)
    follow_up = request(np.concatenate((history, prompt(50, 5))), "private-2")
    assert pol.choose(follow_up, replicas) is home


def test_cache_aware_forgets_a_removed_replica():
    replicas, pol = fleet(3), policy("cache_aware")
    history = prompt(1000)
    home = dispatch(pol, request(history), replicas)
    pol.on_replica_removed(home)
    rest = [r for r in replicas if r is not home]
    follow_up = request(np.concatenate((history, prompt(10, 5000))))
    assert pol.choose(follow_up, rest) in rest
    assert follow_up.predicted_cached_tokens == 0
    assert pol.index.num_entries() == 0


def test_sglang_cache_aware_goes_least_loaded_when_the_fleet_is_imbalanced():
    replicas, pol = fleet(2), policy("sglang_cache_aware")
    history = prompt(1000)
    pol.on_dispatch(request(history), replicas[0])
    follow_up = request(np.concatenate((history, prompt(10, 5000))))
    assert pol.choose(follow_up, replicas) is replicas[0]  # balanced: match rate ~ 0.98
    replicas[0].outstanding_requests = 100  # 100 - 0 > 64 and 100 > 1.5 * 0
    assert pol.choose(follow_up, replicas) is replicas[1]
    replicas[1].outstanding_requests = 40  # 100 - 40 < 64: balanced again
    assert pol.choose(follow_up, replicas) is replicas[0]


def test_sglang_cache_aware_needs_both_imbalance_thresholds_to_balance():
    replicas, pol = fleet(2), policy("sglang_cache_aware")
    history = prompt(1000)
    pol.on_dispatch(request(history), replicas[0])
    follow_up = request(np.concatenate((history, prompt(10, 5000))))
    replicas[0].outstanding_requests, replicas[1].outstanding_requests = 300, 220
    # 300 - 220 > 64, but 300 < 1.5 x 220: not imbalanced, so the cache decides.
    assert pol.choose(follow_up, replicas) is replicas[0]
    replicas[1].outstanding_requests = 190  # 300 > 1.5 x 190 and 110 > 64: imbalanced
    assert pol.choose(follow_up, replicas) is replicas[1]


def test_sglang_cache_aware_sends_low_matches_to_the_smallest_tree():
    replicas, pol = fleet(3), policy("sglang_cache_aware")
    shared = prompt(128)
    pol.on_dispatch(request(prompt(2000, 10**6)), replicas[0])  # a big tree
    pol.on_dispatch(request(shared), replicas[1])
    pol.on_dispatch(request(prompt(64, 7 * 10**6)), replicas[2])  # the smallest tree
    low_match = request(np.concatenate((shared, prompt(1000, 9 * 10**6))))  # rate 0.11 < 0.3
    assert pol.choose(low_match, replicas) is replicas[2]


def test_sglang_cache_aware_uses_sglang_defaults():
    config = PolicyConfig().sglang
    defaults = (config.cache_threshold, config.balance_abs_threshold, config.balance_rel_threshold)
    assert defaults == (0.3, 64, 1.5)


def held_events(tokens: np.ndarray, medium: str, seq: int = 1) -> list[KVEvent]:
    """What a replica publishes when it holds ``tokens`` in one tier (16-token blocks)."""
    hashes = tuple(block_hashes(tokens, 16, SEED))
    data = tokens[: len(hashes) * 16].tobytes()
    return [KVEvent(seq, "stored", hashes, None, tuple(range(len(hashes))), medium, data)]


@pytest.mark.parametrize("name", ["cache_aware", "cache_aware_ttft"])
def test_cache_aware_prefers_a_gpu_hit_then_a_host_hit_then_a_miss(name):
    history = prompt(2048)
    follow_up = request(np.concatenate((history, prompt(40, 90_000))))
    replicas, pol = fleet(3), policy(name)
    for replica in replicas:
        pol.on_replica_added(replica)
    pol.on_kv_events(replicas[1], held_events(history, "CPU"))
    pol.on_kv_events(replicas[2], held_events(history[:1024], "GPU"))
    pol.on_kv_events(replicas[2], held_events(history, "CPU", seq=2))  # the rest on its host
    # Every replica idle: the one with half on its GPU and the rest on its host wins,
    # then the one with all of it on its host, never the one that would recompute.
    assert pol.choose(follow_up, replicas) is replicas[2]
    assert follow_up.predicted_cached_tokens == 2048  # the engine counts host hits as cached
    assert pol.choose(follow_up, replicas[:2]) is replicas[1]
    assert follow_up.predicted_cached_tokens == 2048
    # A GPU hit beats a host hit of the same length.
    pol.on_kv_events(replicas[0], held_events(history, "GPU", seq=3))
    assert pol.choose(follow_up, replicas) is replicas[0]


def test_the_tier_blind_variant_counts_host_tokens_as_misses():
    history = prompt(2048)
    follow_up = request(np.concatenate((history, prompt(40, 90_000))))
    replicas = fleet(3)
    blind = policy("cache_aware_tier_blind")
    for replica in replicas:
        blind.on_replica_added(replica)
    blind.on_kv_events(replicas[1], held_events(history, "CPU"))
    blind.choose(follow_up, replicas)
    assert follow_up.predicted_cached_tokens == 0  # it sees nothing held anywhere


def test_routers_that_share_nothing_send_a_sessions_turns_to_one_replica_by_its_key():
    system = prompt(1500)
    first_router, second_router = policy("cache_aware_approx", 1), policy("cache_aware_approx", 2)
    their_fleets = fleet(4), fleet(4)
    homes = Counter()
    for i in range(20):
        history = np.concatenate((system, prompt(400, 10_000 * (i + 1))))
        turns = [request(history, f"s{i}/0"), request(np.concatenate((history, prompt(60, 7))))]
        for turn in turns:
            turn.session = f"session-{i}"
        chosen = []
        for router, replicas, turn in zip(
            (first_router, second_router), their_fleets, turns, strict=True
        ):
            replica = dispatch(router, turn, replicas)
            complete(router, turn, replica)
            chosen.append(replica.replica_id)
        assert chosen[0] == chosen[1]  # the second router never saw the first turn
        homes[chosen[0]] += 1
    assert len(homes) == 4  # and the keys spread the sessions


def test_a_session_leaves_an_overloaded_home_and_precise_replicas_are_known_by_events():
    history = prompt(2048)
    replicas, approximate = fleet(2), policy("cache_aware_approx")
    turn = request(history, "s/0")
    turn.session = "session-7"
    home = approximate.choose(turn, replicas)
    home.outstanding_requests = 80  # far beyond 1.5 times the fleet's mean
    assert approximate.choose(turn, replicas) is not home
    home.outstanding_requests = 0
    # Fed by events, the router knows the history is elsewhere: the key assumes nothing.
    precise, elsewhere = policy("cache_aware"), next(r for r in replicas if r is not home)
    for replica in replicas:
        precise.on_replica_added(replica)
    precise.on_kv_events(elsewhere, held_events(history[:1024], "GPU"))
    assert precise.choose(turn, replicas) is elsewhere


def test_each_policy_reads_its_own_settings_set_by_their_flags_names():
    config = PolicyConfig.of(stride=8, recompute_weight=2.0, cache_threshold=0.5)
    assert config.index.stride == 8 and config.cache_aware.recompute_weight == 2.0
    assert config.sglang.cache_threshold == 0.5 and config.replication == PolicyConfig().replication
    with pytest.raises(TypeError, match="no knob named nope"):
        PolicyConfig.of(nope=1)
    with pytest.raises(ValueError, match="cache_threshold must lie in"):
        PolicyConfig.of(cache_threshold=2.0)


class RecordedStream:
    """A replica's KV stream as the fleet shows it to the policy (``router.core.KVStream``):
    where the index stands, and the replays asked of it."""

    def __init__(self, indexed_through: int) -> None:
        self.indexed_through: int | None = indexed_through
        self.replays: list[int] = []

    def replay_since(self, batch: int) -> None:
        self.replays.append(batch)


def test_an_answer_below_what_the_events_said_drops_them_and_replays_the_stream():
    """Events said the replica held the prompt; its engine found none of it, and no
    eviction was told: the index and the engine disagree. The prompt's entries go, the
    stream is applied again from the dispatch on, and the answer is counted apart."""
    history = prompt(2048)
    asked = request(np.concatenate((history, prompt(40, 90_000))))
    replicas, pol = fleet(2), policy("cache_aware")
    stream = replicas[0].kv_stream = RecordedStream(indexed_through=7)
    for replica in replicas:
        pol.on_replica_added(replica)
    pol.on_kv_events(replicas[0], held_events(history, "GPU"))
    chosen = dispatch(pol, asked, replicas)
    assert chosen is replicas[0] and asked.predicted_cached_tokens == 2048
    assert (asked.events_cached_tokens, asked.events_batch) == (2048, 7)
    load.completed(pol, asked, chosen, cached_tokens=0)  # blocks let go without an event
    assert (chosen.event_disagreements, chosen.decision_corrections) == (1, 0)
    assert asked.over_cause == "unexplained"
    assert stream.replays == [7]
    assert pol.holders(asked) == {}  # what the events said of it is dropped
    assert pol.prefix_index().events_held(chosen.replica_id, asked.stride_hashes) == 0


def test_an_answer_below_what_only_the_decisions_said_is_a_correction_not_a_disagreement():
    """The events said nothing (a decision did), or told of the eviction while the
    request waited: the events and the engine agree; no replay."""
    history = prompt(2048)
    replicas, pol = fleet(1), policy("cache_aware")
    stream = replicas[0].kv_stream = RecordedStream(indexed_through=3)
    pol.on_replica_added(replicas[0])
    routed = request(history, "routed")
    dispatch(pol, routed, replicas)  # the index learns it from its decision alone
    again = request(history, "again")
    dispatch(pol, again, replicas)
    assert again.predicted_cached_tokens == 2032 and again.events_cached_tokens == 0
    load.completed(pol, again, replicas[0], cached_tokens=0)
    load.completed(pol, routed, replicas[0], cached_tokens=0)
    assert (replicas[0].event_disagreements, replicas[0].decision_corrections) == (0, 1)
    assert (again.over_cause, routed.over_cause) == ("pending", None)

    told = request(history, "told")
    pol.on_kv_events(replicas[0], held_events(history, "GPU"))
    dispatch(pol, told, replicas)
    assert told.events_cached_tokens == 2032
    removed = held_events(history, "GPU", seq=2)[0].block_hashes
    pol.on_kv_events(replicas[0], [KVEvent(3, "removed", removed, medium="GPU")])
    load.completed(pol, told, replicas[0], cached_tokens=0)  # evicted while it waited
    assert (replicas[0].event_disagreements, replicas[0].decision_corrections) == (0, 2)
    assert told.over_cause == "evicted"
    assert stream.replays == []
