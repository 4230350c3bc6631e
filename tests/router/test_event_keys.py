"""The router's keys from a replica's events: the same as a prompt's, whatever the engine's
hash, chained across events and tiers, forgotten when no tier holds a block."""

import numpy as np

from replica.api.identity import DEFAULT_MODEL, identity_seed, prefix_keys
from replica.api.kv_events import KVEvent
from replica.engine import Engine, EngineConfig, EngineRequest
from router.index.event_keys import EventKeys
from tests.shared import prompt

BLOCK, STRIDE = 16, 4


def keys_of(tokens: np.ndarray, salt: str | None = None) -> list[int]:
    return prefix_keys(tokens, BLOCK, STRIDE, identity_seed(DEFAULT_MODEL, salt))


def stored(hashes, tokens: np.ndarray, parent=None, medium="GPU", salt=None) -> KVEvent:
    return KVEvent(1, "stored", tuple(hashes), parent, (), medium, tokens.tobytes(), salt)


def test_keys_from_events_equal_the_prompts_whatever_the_engine_hashes():
    tokens = prompt(16 * 10)
    keys = EventKeys(DEFAULT_MODEL, BLOCK, STRIDE)
    # vLLM names blocks by sha256 bytes: the router does not care.
    engine_hashes = [bytes([i]) * 32 for i in range(10)]
    first = keys.stored(stored(engine_hashes[:3], tokens[:48]))
    rest = keys.stored(stored(engine_hashes[3:], tokens[48:], parent=engine_hashes[2]))
    assert first + rest == keys_of(tokens)  # boundaries at blocks 4 and 8, across events
    assert keys.removed(KVEvent(2, "removed", tuple(engine_hashes[7:]))) == keys_of(tokens)[1:]


def test_a_real_engines_events_key_exactly_the_cached_prefix():
    engine = Engine(EngineConfig(num_blocks=64, block_size=BLOCK, host_blocks=0))
    engine.add_request(EngineRequest("r", prompt(700), 1, cache_salt="acme"))
    while engine.has_unfinished:
        engine.step()
    keys = EventKeys(DEFAULT_MODEL, BLOCK, STRIDE)
    found = [k for e in engine.cache.events_since(0)[0] for k in keys.stored(e)]
    assert found == keys_of(prompt(700), salt="acme")[: 43 // STRIDE]
    assert found[0] != keys_of(prompt(700))[0]  # tenants never share keys


def test_a_block_without_a_known_parent_is_not_keyed():
    keys = EventKeys(DEFAULT_MODEL, BLOCK, STRIDE)
    assert keys.stored(stored([7, 8, 9, 10], prompt(64), parent=6)) == []
    assert keys.unkeyed == 4 and len(keys) == 0
    other_size = stored([1, 2], prompt(64))  # 32-token blocks: not our block size
    assert keys.stored(other_size, block_size=32) == [] and keys.unkeyed == 6


def test_tiers_share_chains_and_a_block_is_forgotten_when_no_tier_holds_it():
    tokens = prompt(16 * 8)
    keys = EventKeys(DEFAULT_MODEL, BLOCK, STRIDE)
    assert keys.stored(stored(range(4), tokens[:64])) == keys_of(tokens)[:1]
    # The GPU evicts the tail of a longer prompt to the host: its parent is on the GPU.
    keys.stored(stored(range(4, 6), tokens[64:96], parent=3))
    assert keys.removed(KVEvent(2, "removed", (5, 4))) == []
    assert keys.stored(stored([4, 5], tokens[64:96], parent=3, medium="CPU")) == []
    assert (
        keys.stored(stored([6, 7], tokens[96:128], parent=5, medium="CPU")) == keys_of(tokens)[1:2]
    )
    assert keys.removed(KVEvent(3, "removed", (3,), medium="CPU")) == []  # not on the host
    assert keys.removed(KVEvent(4, "removed", (3, 2, 1, 0))) == keys_of(tokens)[:1]
    assert keys.removed(KVEvent(5, "removed", (7, 6, 5, 4), medium="CPU")) == keys_of(tokens)[1:2]
    assert len(keys) == 0


def test_each_salts_blocks_on_the_gpu_are_counted():
    """A tenant's footprint: its chains' blocks, counted while the GPU holds them (a
    copy on the host is not), from a real engine's events and by hand."""
    engine = Engine(EngineConfig(num_blocks=64, block_size=BLOCK, host_blocks=0))
    for salt, length in (("acme", 700), ("globex", 300), (None, 100)):
        engine.add_request(EngineRequest(str(salt), prompt(length), 1, cache_salt=salt))
    while engine.has_unfinished:
        engine.step()
    keys = EventKeys(DEFAULT_MODEL, BLOCK, STRIDE)
    for event in engine.cache.events_since(0)[0]:
        keys.stored(event)
    assert keys.gpu_blocks_by_salt == {"acme": 43, "globex": 18, None: 6}

    tokens = prompt(16 * 6)
    keys = EventKeys(DEFAULT_MODEL, BLOCK, STRIDE)
    keys.stored(stored(range(4), tokens[:64], salt="acme"))
    keys.stored(stored([4, 5], tokens[64:], parent=3))  # a child: its root's salt
    assert keys.gpu_blocks_by_salt == {"acme": 6}
    keys.stored(stored([4, 5], tokens[64:], parent=3, medium="CPU"))  # copied to the host
    keys.removed(KVEvent(2, "removed", (5, 4)))  # gone from the GPU
    assert keys.gpu_blocks_by_salt == {"acme": 4}
    keys.removed(KVEvent(3, "removed", (0, 1, 2, 3)))
    assert keys.gpu_blocks_by_salt == {}
