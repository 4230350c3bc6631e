"""The packed tables in C answer as their Python twins do, operation by operation, on
random event streams and random replica sets (growth, deletion, masks shared and
freed); and they are the ones in use where a compiler is."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from router.index import lean_index
from router.index.lean_index import CPU_TIER, GPU_TIER, PyBlockTable, PyKeySets

BLOCK_BYTES = 16 * 4


def test_the_tables_are_compiled_where_a_compiler_is():
    # This machine has one (make install builds it): the packed tables must be in use.
    assert lean_index.BlockTable is not PyBlockTable and lean_index.KeySets is not PyKeySets


# One operation: store a run of blocks after a parent (or none), or remove some blocks.
operation = st.tuples(
    st.sampled_from(["stored", "stored", "removed"]),
    st.integers(0, 40),  # the parent's hash (0: a root)
    st.lists(st.integers(1, 40), min_size=1, max_size=6),  # the blocks' hashes
    st.sampled_from([GPU_TIER, CPU_TIER]),
    st.integers(0, 2),  # the salt's number
    st.integers(0, 3),  # which tokens: a few, so that chains meet again
)


@settings(max_examples=300, deadline=None)
@given(operations=st.lists(operation, max_size=60), stride=st.sampled_from([1, 3, 4]))
def test_a_block_table_answers_as_its_python_twin(operations, stride):
    packed, twin = lean_index.BlockTable(4), PyBlockTable(4)  # both grow from 4
    for kind, parent, hashes, tier, salt, tokens in operations:
        if kind == "removed":
            assert packed.removed(hashes, tier) == twin.removed(hashes, tier)
        else:
            data = np.full(len(hashes) * 16, tokens, dtype=np.uint32).tobytes()
            args = (parent or None, 7, salt, data, hashes, BLOCK_BYTES, stride, tier)
            assert packed.stored(*args) == twin.stored(*args)
        assert len(packed) == len(twin)
    packed.clear()
    assert len(packed) == 0 and packed.stored(1, 7, 0, b"", [], BLOCK_BYTES, stride, 1) is None


def test_block_hashes_may_be_bytes_or_any_int():
    packed, twin = lean_index.BlockTable(), PyBlockTable()
    hashes = [b"\x01" * 32, -5, 2**70 + 3, 12]  # sha256 bytes, a negative int, a big one
    data = bytes(len(hashes) * BLOCK_BYTES)
    assert packed.stored(None, 1, 0, data, hashes, BLOCK_BYTES, 2, GPU_TIER) == twin.stored(
        None, 1, 0, data, hashes, BLOCK_BYTES, 2, GPU_TIER
    )
    after = packed.stored(b"\x01" * 32, 1, 0, data[:BLOCK_BYTES], [99], BLOCK_BYTES, 2, GPU_TIER)
    assert after is not None and after[0]  # found by its bytes: block 2 is a stride block


change = st.tuples(
    st.sampled_from(["add", "add", "discard", "clear"]),
    st.integers(0, 70),  # the replica's bit: past 64, masks are longer ints
    st.lists(st.integers(0, 2**64 - 1) | st.integers(0, 30), max_size=12),
)


@settings(max_examples=300, deadline=None)
@given(changes=st.lists(change, max_size=80))
def test_key_sets_answer_as_their_python_twin(changes):
    packed, twin = lean_index.KeySets(), PyKeySets()
    touched = set()
    for kind, bit, keys in changes:
        if kind == "clear":
            packed.clear(bit)
            twin.clear(bit)
        else:
            getattr(packed, kind)(bit, keys)
            getattr(twin, kind)(bit, keys)
        touched |= set(keys)
        assert len(packed) == len(twin) and packed.masks == twin.masks
        assert packed.size(bit) == twin.size(bit)
    assert all(packed.get(key, 0) == twin.get(key, 0) for key in touched)
    assert all(sorted(packed.held(bit)) == sorted(twin.held(bit)) for bit in range(71))


def test_clearing_a_replica_from_a_big_table_keeps_every_other_key_reachable():
    """Deleting shifts later slots back: every key left must still be found."""
    rng = np.random.default_rng(0)
    packed, twin = lean_index.KeySets(), PyKeySets()
    for bit in range(8):
        keys = [int(k) for k in rng.integers(0, 2**63, 5_000)]
        shared = keys[:1000]
        for sets in (packed, twin):
            sets.add(bit, keys)
            sets.add((bit + 1) % 8, shared)
    for bit in (3, 5):
        packed.clear(bit)
        twin.clear(bit)
    assert len(packed) == len(twin) and packed.masks == twin.masks
    assert all(sorted(packed.held(bit)) == sorted(twin.held(bit)) for bit in range(8))
    assert packed.size(3) == 0 and packed.size(4) == twin.size(4) > 0


def test_an_index_on_the_python_twins_predicts_as_one_on_the_packed_tables(monkeypatch):
    """Where no compiler built the tables, the index runs on the twins: same answers."""
    from replica.api.identity import DEFAULT_MODEL, identity_seed, prefix_keys
    from replica.engine import Engine, EngineConfig, EngineRequest
    from router.index import event_keys, prefix_index
    from tests.shared import prompt

    rng = np.random.default_rng(3)
    engines = [Engine(EngineConfig(num_blocks=96, block_size=16, host_blocks=64)) for _ in "ab"]
    prompts = [
        prompt(int(rng.integers(100, 900)), 1000 * int(rng.integers(0, 6))) for _ in range(40)
    ]
    for i, tokens in enumerate(prompts):  # evictions to the host and beyond
        engine = engines[i % 2]
        engine.add_request(EngineRequest(f"r{i}", tokens, 1, cache_salt=f"t{i % 3}"))
        while engine.has_unfinished:
            engine.step()

    def index() -> prefix_index.PrefixIndex:
        built = prefix_index.PrefixIndex(prefix_index.IndexConfig(), 16, lambda: 0.0)
        for name, engine in zip("ab", engines, strict=True):
            built.add_replica(name, 96)
            built.apply_events(name, engine.cache.events_since(0)[0])
        return built

    packed = index()
    monkeypatch.setattr(event_keys, "BlockTable", PyBlockTable)
    monkeypatch.setattr(prefix_index, "KeySets", PyKeySets)
    twin = index()
    assert isinstance(twin.stored, PyKeySets) and not isinstance(packed.stored, PyKeySets)
    answers = 0
    for i, tokens in enumerate(prompts):
        keys = prefix_keys(tokens, 16, 4, identity_seed(DEFAULT_MODEL, f"t{i % 3}"))
        gpu = packed.match(keys)
        assert gpu == twin.match(keys)
        assert packed.match_host(keys, gpu) == twin.match_host(keys, gpu)
        answers += bool(gpu)
    assert answers  # something was held, on the GPU and in the host tier
    assert packed.host is not None and twin.host is not None
    assert len(packed.host) == len(twin.host) > 0
    for name in "ab":
        assert packed.gpu_blocks_by_salt(name) == twin.gpu_blocks_by_salt(name)
        assert packed.num_entries(name) == twin.num_entries(name) > 0
