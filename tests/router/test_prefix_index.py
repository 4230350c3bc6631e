"""The router's prefix index: matches, approximate learning, precise events, bounds."""

import numpy as np
import pytest

from replica.api.identity import DEFAULT_MODEL, block_hashes, identity_seed, prefix_keys
from replica.api.kv_events import KVEvent
from replica.api.tokenizer import TOKEN_DTYPE
from replica.engine import Engine, EngineConfig
from replica.sequence import EngineRequest
from router.index.lean_index import KeySets
from router.index.prefix_index import IndexConfig, PrefixIndex
from tests.shared import FakeClock, prompt

BLOCK, STRIDE = 16, 4
SEED = identity_seed(DEFAULT_MODEL)


def stride_hashes(tokens: np.ndarray) -> list[int]:
    return prefix_keys(tokens, BLOCK, STRIDE, SEED)


def make_index(mode: str = "approximate", clock: FakeClock | None = None, **config) -> PrefixIndex:
    index = PrefixIndex(
        IndexConfig(mode=mode, stride=STRIDE, **config), BLOCK, clock or FakeClock()
    )
    for name in ("a", "b", "c"):
        index.add_replica(name, capacity_blocks=64)
    return index


def test_match_reports_the_leading_tokens_each_replica_holds():
    index = make_index()
    index.record_routing("a", stride_hashes(prompt(640)))
    index.record_routing("b", stride_hashes(prompt(256)))
    assert index.match(stride_hashes(prompt(1000))) == {"a": 640, "b": 256}  # c holds none
    # a different prompt that shares the first 128 tokens with both
    other = np.concatenate((prompt(128), prompt(500, 10_000)))
    assert index.match(stride_hashes(other)) == {"a": 128, "b": 128}


def test_approximate_entries_are_an_lru_sized_to_the_replica_capacity():
    index = make_index()
    for i in range(50):  # 50 prompts of 4 stride blocks: far over 64 blocks / stride 4
        index.record_routing("a", stride_hashes(prompt(256, 1000 * i)))
    assert index.num_entries("a") == 64 // STRIDE
    assert index.match(stride_hashes(prompt(256, 49_000))).get("a", 0) == 256  # newest kept
    assert index.match(stride_hashes(prompt(256, 0))).get("a", 0) == 0  # oldest forgotten


def test_approximate_entries_expire_after_the_ttl(clock):
    index = make_index(clock=clock, ttl_s=10.0)
    index.record_routing("a", stride_hashes(prompt(256)))
    clock.now = 9.0
    assert index.match(stride_hashes(prompt(256))).get("a", 0) == 256
    clock.now = 10.5
    assert index.match(stride_hashes(prompt(256))).get("a", 0) == 0
    assert index.num_entries() == 0


def engine_holding(tokens: np.ndarray) -> Engine:
    """An engine of 64 blocks that has served ``tokens``."""
    engine = Engine(EngineConfig(num_blocks=64, block_size=BLOCK))
    engine.add_request(EngineRequest("r", tokens, 1))
    while engine.has_unfinished:
        engine.step()
    return engine


def test_precise_mode_mirrors_an_engines_events_at_stride_boundaries(clock):
    index = make_index("precise", clock, recent_s=2.0)
    engine = engine_holding(prompt(700))
    events, _ = engine.cache.events_since(0)
    index.apply_events("b", events)
    # 700 tokens: 43 full blocks cached; stride boundaries every 64 tokens.
    assert index.match(stride_hashes(prompt(1000))).get("b", 0) == 640
    assert index.num_entries("b") == 43 // STRIDE  # only stride-boundary blocks are kept
    # Eviction by a new request shrinks the chain from its tail.
    engine.add_request(EngineRequest("s", prompt(600, 50_000), 1))
    while engine.has_unfinished:
        engine.step()
    events, _ = engine.cache.events_since(events[-1].seq)
    index.apply_events("b", events)
    held = index.match(stride_hashes(prompt(1000))).get("b", 0)
    cached = len(
        engine.cache.match(block_hashes(prompt(1000), BLOCK, SEED), prompt(1000).tobytes())
    )
    assert held == cached * BLOCK // (BLOCK * STRIDE) * BLOCK * STRIDE < 640


def test_precise_mode_counts_recent_routing_until_events_arrive(clock):
    index = make_index("precise", clock, recent_s=2.0)
    index.record_routing("c", stride_hashes(prompt(256)))
    assert index.match(stride_hashes(prompt(256))).get("c", 0) == 256
    clock.now = 3.0
    assert index.match(stride_hashes(prompt(256))).get("c", 0) == 0


def test_a_request_in_flight_keeps_its_prompt_where_it_waits_whatever_the_events_say(clock):
    """Past capacity an engine short of KV evicts the cached prompt of requests still in
    its queue: it computes the prompt again for them, so the prompt is held there (as
    far as routing goes) until the last of them ends; then the events alone say."""
    index = make_index("precise", clock, recent_s=5.0)
    engine = Engine(EngineConfig(num_blocks=48, block_size=BLOCK))
    hashes = stride_hashes(prompt(700))
    served(engine, "r", prompt(700))
    index.apply_events("b", engine.cache.events_since(0)[0])
    for _ in range(2):  # two more of the prompt, queued on b
        index.record_routing("b", hashes)
        index.request_started("b", hashes)
    seen = engine.cache.events_since(0)[0][-1].seq
    served(engine, "s", prompt(700, 50_000))  # 44 more blocks: most of the first go
    index.apply_events("b", engine.cache.events_since(seen)[0])
    clock.now = 60.0  # long past recent_s: they still wait
    assert index.match(hashes) == {"b": 640}
    index.request_ended("b", hashes)
    assert index.match(hashes) == {"b": 640}  # one still waits
    index.request_ended("b", hashes)
    held = engine.cache.match(block_hashes(prompt(700), BLOCK, SEED), prompt(700).tobytes())
    assert index.match(hashes).get("b", 0) == len(held) // STRIDE * BLOCK * STRIDE < 640
    assert index.num_entries("b") == index.gpu_keys("b")  # nothing in flight is left
    approximate = make_index("approximate", clock)
    approximate.request_started("a", hashes)  # its decisions stand for it
    assert approximate.num_entries() == 0


def test_the_gpu_keys_are_the_events_of_a_precise_replica_and_the_decisions_of_others(clock):
    index = make_index("precise", clock, recent_s=2.0)
    index.add_replica("d", capacity_blocks=64, approximate=True)
    index.apply_events("b", engine_holding(prompt(700)).cache.events_since(0)[0])
    index.record_routing("d", stride_hashes(prompt(512)))
    index.record_routing("a", stride_hashes(prompt(512, 9_000)))  # not shown by events yet
    assert (index.gpu_keys("a"), index.gpu_keys("b"), index.gpu_keys("d")) == (0, 10, 8)


def test_a_decision_records_only_what_the_replicas_events_do_not_show(clock):
    index = make_index("precise", clock, recent_s=2.0)
    index.apply_events("b", engine_holding(prompt(700)).cache.events_since(0)[0])  # 10 strides
    next_turn = stride_hashes(prompt(1000))  # 15 strides, the first 10 shown by events
    index.record_routing("b", next_turn)
    assert index.routed.size(index._bits["b"]) == 5  # its new strides, not its history
    assert index.match(next_turn) == {"b": 960}
    clock.now = 3.0  # the decision expires; the events still say what is there
    assert index.match(next_turn) == {"b": 640}
    index.record_routing("a", next_turn)  # nothing shown on "a": all of it recorded
    assert index.routed.size(index._bits["a"]) == 15


def test_a_cleared_event_forgets_everything_of_that_replica():
    index = make_index("precise")
    engine = Engine(EngineConfig(num_blocks=64, block_size=BLOCK))
    engine.add_request(EngineRequest("r", prompt(300), 1))
    while engine.has_unfinished:
        engine.step()
    assert engine.reset_cache()
    events, _ = engine.cache.events_since(0)
    index.apply_events("a", events)
    assert index.num_entries("a") == 0


def test_removing_a_replica_removes_all_its_entries():
    index = make_index()
    index.record_routing("a", stride_hashes(prompt(512)))
    index.record_routing("b", stride_hashes(prompt(512)))
    index.remove_replica("a")
    assert "a" not in index.match(stride_hashes(prompt(512)))
    assert index.num_entries() == 512 // (BLOCK * STRIDE)  # b's entries only
    index.add_replica("a", 64)  # re-admitted: empty
    assert index.match(stride_hashes(prompt(512))).get("a", 0) == 0


def test_memory_is_bounded_by_total_capacity_whatever_the_traffic():
    index = make_index("precise")
    rng = np.random.default_rng(0)
    for i in range(2000):
        replica = "abc"[i % 3]
        tokens = rng.integers(0, 2**32, int(rng.integers(64, 2000)), dtype=np.uint64)
        index.record_routing(replica, stride_hashes(tokens.astype(TOKEN_DTYPE)))
    assert index.num_entries() <= 3 * 64 // STRIDE


def test_event_tables_are_bounded_by_capacity_even_when_removals_are_lost():
    """An engine of 64 blocks serving 300 prompts, every one of its removal events lost:
    the replica's events would say it holds thousands of blocks (2,137 stride keys and
    8,994 blocks before the bound). Past twice its capacity they are not believed:
    forgotten, and learned again from the next events."""
    index = make_index("precise")
    engine = Engine(EngineConfig(num_blocks=64, block_size=BLOCK))
    rng, seen, most = np.random.default_rng(0), 0, 0
    for i in range(300):
        tokens = rng.integers(1, 30_000, int(rng.integers(64, 900)))
        engine.add_request(EngineRequest(f"r{i}", tokens, 1))
        while engine.has_unfinished:
            engine.step()
        events, _ = engine.cache.events_since(seen)
        seen = engine.cache.last_event_seq
        index.apply_events("a", [e for e in events if e.kind == "stored"])
        most = max(most, index.num_entries("a"), index.gpu_keys("a"))
    assert most <= 2 * 64 // STRIDE + 900 // BLOCK // STRIDE  # one batch past the bound
    assert index.overfull_resets["a"] > 10
    # with every event delivered, the same engine never trips the bound
    whole = make_index("precise")
    whole.apply_events("a", engine.cache.events_since(0)[0])
    assert whole.overfull_resets["a"] == 0 and whole.num_entries("a") <= 64 // STRIDE


def test_invalid_configs_are_refused():
    with pytest.raises(ValueError, match="mode"):
        IndexConfig(mode="psychic")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        IndexConfig(stride=0)


def test_the_galloping_match_equals_a_plain_scan_on_random_fleets():
    rng = np.random.default_rng(7)
    clock = FakeClock()
    for trial in range(40):
        index = make_index("approximate" if trial % 2 else "precise", clock)
        longest = 3_000 if trial % 4 < 2 else 40_000  # long ones: gallops of many doublings
        prompts = [
            prompt(int(rng.integers(64, longest)), 100_000 * int(rng.integers(0, 5)))
            for _ in range(30)
        ]
        for tokens in prompts:  # prefixes of five base prompts, on random replicas
            cut = int(rng.integers(1, len(tokens) + 1))
            index.record_routing("abc"[int(rng.integers(3))], stride_hashes(tokens[:cut]))
        for tokens in prompts[:10]:
            hashes = stride_hashes(tokens)
            expected = {}
            for name, bit in index._bits.items():
                held = 0
                while held < len(hashes) and (index.routed.holders.get(hashes[held], 0) >> bit) & 1:
                    held += 1
                if held:
                    expected[name] = held * BLOCK * STRIDE
            assert index.match(hashes) == expected


def test_both_tiers_match_a_plain_scan_on_a_large_fleet():
    """Only the replicas that hold a prompt's first identity are followed: on a fleet of
    200, what they answer is still what a scan of every replica answers."""
    rng = np.random.default_rng(11)
    index = make_index("precise")
    names = [f"r{i}" for i in range(200)]
    for name in names:
        index.add_replica(name, 4096)
    bases = [stride_hashes(prompt(2000, 10_000 * b)) for b in range(4)]
    for _ in range(300):  # GPU and host prefixes of four prompts, on random replicas
        hashes = bases[int(rng.integers(4))]
        bit = index._bits[names[int(rng.integers(200))]]
        start = int(rng.integers(0, len(hashes)))
        cut = int(rng.integers(start, len(hashes) + 1))
        index.stored.add(bit, hashes[:start])  # type: ignore[union-attr]
        index.host.add(bit, hashes[start:cut])  # type: ignore[union-attr]

    def run(holders: KeySets, bit: int, hashes: list[int], depth: int) -> int:
        while depth < len(hashes) and (holders.get(hashes[depth], 0) >> bit) & 1:
            depth += 1
        return depth

    for hashes in bases:
        gpu, host = {}, {}
        for name, bit in index._bits.items():
            held = run(index.stored, bit, hashes, 0)  # type: ignore[arg-type]
            more = run(index.host, bit, hashes, held) - held  # type: ignore[arg-type]
            if held:
                gpu[name] = held * BLOCK * STRIDE
            if more:
                host[name] = more * BLOCK * STRIDE
        assert index.match(hashes) == gpu and gpu
        assert index.match_host(hashes, gpu) == host and host


def test_popularity_counts_recent_requests_per_prefix_and_forgets_by_halving():
    from router.index.prefix_index import PrefixPopularity

    popularity = PrefixPopularity(half_life_requests=100)
    shared = [1, 2, 3]
    for i in range(5):
        assert popularity.depth([*shared, 1000 + i], threshold=5) == 0
        popularity.record([*shared, 1000 + i])
    assert popularity.depth([*shared, 999], threshold=5) == 3  # the shared strides
    assert popularity.depth([*shared, 999], threshold=6) == 0
    assert popularity.depth([1, 2], threshold=5) == 2 and popularity.depth([], 5) == 0
    for i in range(10_000):  # unique traffic: halving keeps memory bounded
        popularity.record([10_000 + i])
    assert len(popularity) < 200
    assert popularity.depth(shared, threshold=5) == 0  # and old popularity fades


def test_host_tier_events_say_how_much_further_a_replica_holds_a_prompt():
    """A real engine with a host tier: its GPU evicts the prompt's tail to the host; the
    index follows both tiers from the events and never confuses them."""
    index = make_index("precise")
    engine = Engine(EngineConfig(num_blocks=48, block_size=BLOCK, host_blocks=256))
    engine.add_request(EngineRequest("r", prompt(700), 1))
    while engine.has_unfinished:
        engine.step()
    engine.add_request(EngineRequest("s", prompt(400, 50_000), 1))  # needs 26 of 48 blocks
    while engine.has_unfinished:
        engine.step()
    events, _ = engine.cache.events_since(0)
    assert {e.medium for e in events} == {"GPU", "CPU"}
    index.apply_events("b", events)
    hashes = stride_hashes(prompt(1000))
    gpu = index.match(hashes)
    on_gpu = len(
        engine.cache.match(block_hashes(prompt(1000), BLOCK, SEED), prompt(1000).tobytes())
    )
    assert gpu.get("b", 0) == on_gpu // STRIDE * BLOCK * STRIDE < 640
    extra = index.match_host(hashes, gpu)
    assert gpu.get("b", 0) + extra["b"] == 640  # the rest of the prompt, in host memory
    assert "a" not in extra and "c" not in extra
    assert engine.reset_cache()
    index.apply_events("b", engine.cache.events_since(events[-1].seq)[0])
    assert index.match_host(hashes, {}) == {} and index.num_entries("b") == 0


def served(engine: Engine, request_id: str, tokens: np.ndarray) -> None:
    engine.add_request(EngineRequest(request_id, tokens, 1))
    while engine.has_unfinished:
        engine.step()


def test_an_eviction_drops_the_recent_decisions_that_said_the_prefix_was_there(clock):
    """The decision is older news than the engine's removal: after it, the prefix is
    predicted nowhere, although the decision is younger than ``recent_s``."""
    index = make_index("precise", clock, recent_s=5.0)
    engine = Engine(EngineConfig(num_blocks=48, block_size=BLOCK))
    served(engine, "r", prompt(700))
    index.record_routing("b", stride_hashes(prompt(700)))
    index.apply_events("b", engine.cache.events_since(0)[0])
    assert index.match(stride_hashes(prompt(700))) == {"b": 640}
    seen = engine.cache.events_since(0)[0][-1].seq
    served(engine, "s", prompt(700, 50_000))  # 44 more blocks: most of the first go
    index.apply_events("b", engine.cache.events_since(seen)[0])
    held = engine.cache.match(block_hashes(prompt(700), BLOCK, SEED), prompt(700).tobytes())
    assert index.match(stride_hashes(prompt(700))).get("b", 0) == (
        len(held) // STRIDE * BLOCK * STRIDE
    )  # what the engine holds, not what was routed 0 s ago


def test_an_answer_with_fewer_cached_tokens_corrects_the_decisions_at_once(clock):
    index = make_index("precise", clock, recent_s=5.0)
    hashes = stride_hashes(prompt(1000))
    index.record_routing("a", hashes)
    assert index.match(hashes) == {"a": 960}
    index.correct("a", hashes, cached_tokens=300)  # the engine held 300 of them
    assert index.match(hashes) == {"a": 256}  # 4 whole strides, not 15
    approximate = make_index("approximate", clock)
    approximate.record_routing("a", hashes)
    approximate.correct("a", hashes, cached_tokens=0)  # it has just computed them all
    assert approximate.match(hashes) == {"a": 960}


def test_a_replica_whose_events_cannot_be_trusted_is_indexed_from_decisions_alone(clock):
    index = make_index("precise", clock, recent_s=2.0, ttl_s=600.0)
    index.add_replica("d", capacity_blocks=64, approximate=True)
    hashes = stride_hashes(prompt(256))
    index.record_routing("d", hashes)
    index.record_routing("a", hashes)
    clock.now = 100.0  # far past recent_s: the precise replica's decision is gone
    assert index.match(hashes) == {"d": 256}
    engine = Engine(EngineConfig(num_blocks=64, block_size=BLOCK))
    served(engine, "r", prompt(700, 9_000))
    assert index.apply_events("d", engine.cache.events_since(0)[0]) == 0  # ignored
    assert index.match(stride_hashes(prompt(700, 9_000))) == {}
    clock.now = 800.0  # approximate mode's TTL
    assert index.match(hashes) == {}


def test_events_that_cannot_be_keyed_are_counted():
    index = make_index("precise")
    engine = Engine(EngineConfig(num_blocks=64, block_size=2 * BLOCK))  # another block size
    served(engine, "r", prompt(700))
    events = engine.cache.events_since(0)[0]
    blocks = sum(len(e.block_hashes) for e in events if e.kind == "stored")
    assert index.apply_events("a", events) == blocks == 700 // (2 * BLOCK)
    assert index.match(stride_hashes(prompt(700))) == {}


def test_a_disagreement_drops_the_prompt_and_the_batches_since_the_dispatch_restore_it(clock):
    """The engine let the prompt go without an event, then the request computed it again
    and stored it (its events came before its answer). Dropping what the events said
    forgets those blocks too; applying again the events since the dispatch brings them
    back, and applying them twice counts nothing twice."""
    index = make_index("precise", clock, recent_s=0.0)
    engine = Engine(EngineConfig(num_blocks=64, block_size=BLOCK))
    hashes = stride_hashes(prompt(700))
    served(engine, "r", prompt(700))
    index.apply_events("a", engine.cache.events_since(0)[0])
    assert index.events_held("a", hashes) == 640 and index.events_held("b", hashes) == 0
    held_blocks = index.gpu_blocks_of("a", [None])
    assert engine.reset_cache()
    withheld = engine.cache.last_event_seq  # its ``cleared`` never sent
    served(engine, "again", prompt(700))  # found nothing cached: computed and stored again
    since_dispatch = engine.cache.events_since(withheld)[0]
    index.apply_events("a", since_dispatch)
    assert index.match(hashes) == {"a": 640}
    index.disagree("a", hashes, cached_tokens=0)
    assert index.match(hashes) == {} and index.events_held("a", hashes) == 0
    index.apply_events("a", since_dispatch)  # the stream, applied again from the dispatch
    assert index.match(hashes) == {"a": 640}
    assert index.gpu_blocks_of("a", [None]) == held_blocks  # nothing counted twice
    assert index.num_entries("a") == len(hashes)


def test_an_eviction_while_a_request_waits_is_remembered_until_it_ends(clock):
    index = make_index("precise", clock)
    engine = engine_holding(prompt(700))
    events = engine.cache.events_since(0)[0]
    index.apply_events("a", events)
    hashes = stride_hashes(prompt(700))
    index.request_started("a", hashes)
    stored = events[0]
    index.apply_events("a", [KVEvent(99, "removed", stored.block_hashes[-8:])])
    assert index.evicted_in_flight("a", hashes[-2:]) and not index.evicted_in_flight("b", hashes)
    assert not index.evicted_in_flight("a", hashes[:-2])  # still held
    index.request_ended("a", hashes)
    assert not index.evicted_in_flight("a", hashes)
