import numpy as np
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from replica.api import identity
from replica.api.identity import (
    BlockHasher,
    block_hashes,
    identity_seed,
    prefix_keys,
    python_next_key,
    python_prefix_keys,
)
from replica.api.tokenizer import TOKEN_DTYPE

tokens = np.arange(200, dtype=TOKEN_DTYPE)
seed = identity_seed("model")


def test_identity_is_xxh3_of_every_token_up_to_the_block_end():
    expected = xxhash.xxh3_64_intdigest(tokens[:32].tobytes(), seed=seed)
    assert block_hashes(tokens, 16, seed)[1] == expected


def test_identities_are_chunk_invariant():
    by16 = block_hashes(tokens[:128], 16, seed)
    by64 = block_hashes(tokens[:128], 64, seed)
    assert by16[3] == by64[0]  # token 64
    assert by16[7] == by64[1]  # token 128
    assert by16[3::4] == by64


def test_only_full_blocks_have_an_identity():
    assert len(block_hashes(tokens[:47], 16, seed)) == 2
    assert block_hashes(tokens[:15], 16, seed) == []


def test_streaming_in_any_pieces_gives_the_same_identities():
    hasher = BlockHasher(16, seed)
    pieces = [hasher.extend(tokens[a:b]) for a, b in [(0, 5), (5, 40), (40, 41), (41, 200)]]
    assert [h for piece in pieces for h in piece] == block_hashes(tokens, 16, seed)


def test_position_is_part_of_the_identity():
    block = np.full(16, 7, dtype=TOKEN_DTYPE)
    twice = block_hashes(np.concatenate((block, block)), 16, seed)
    assert twice[0] != twice[1]


def test_two_tenants_never_share_an_identity():
    alice = block_hashes(tokens, 16, identity_seed("model", "alice"))
    bob = block_hashes(tokens, 16, identity_seed("model", "bob"))
    nobody = block_hashes(tokens, 16, identity_seed("model"))
    assert not set(alice) & set(bob)
    assert not set(alice) & set(nobody)


def test_models_do_not_share_identities_either():
    assert identity_seed("a") != identity_seed("b")


@settings(max_examples=200, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 2**32 - 1), max_size=700),
    block=st.sampled_from([1, 16, 60, 64]),  # 60 and 64 tokens: either side of 240 bytes
    stride=st.sampled_from([1, 4, 5]),
    seed=st.integers(0, 2**64 - 1),
)
def test_the_compiled_keys_are_the_python_loops(tokens, block, stride, seed):
    array = np.array(tokens, dtype=TOKEN_DTYPE)
    expected = python_prefix_keys(array.tobytes(), block * TOKEN_DTYPE.itemsize, stride, seed)
    assert prefix_keys(array, block, stride, seed) == expected
    assert len(expected) == len(tokens) // block // stride  # full strides only
    assert prefix_keys(array[::1].astype(np.int64), block, stride, seed) == expected


def test_the_keys_are_compiled_where_a_compiler_is():
    # This machine has one (make install builds it): the fast path must be the one in use.
    assert identity._compiled is not None


@settings(max_examples=200, deadline=None)
@given(key=st.integers(0, 2**64 - 1), block=st.binary(max_size=600))
def test_a_chain_continues_alike_compiled_or_not(key, block):
    assert identity.next_key(key, block) == python_next_key(key, block)


def test_a_chain_continued_from_any_key_gives_the_whole_prompts_keys():
    keys = prefix_keys(tokens, 4, 4, seed)  # blocks of 4 tokens (16 bytes), a key per 4
    data = tokens.tobytes()
    # The first link is the first block's identity...
    assert prefix_keys(tokens, 16, 1, seed)[0] == block_hashes(tokens, 16, seed)[0]
    # ...and a chain goes on from a key with the next blocks' tokens alone.
    link = keys[4]
    for block in range(20, 24):
        link = identity.next_key(link, data[block * 16 : (block + 1) * 16])
    assert keys[5] == link


@settings(max_examples=200, deadline=None)
@given(
    common=st.integers(0, 400),
    old_tail=st.lists(st.integers(0, 2**32 - 1), max_size=200),
    new_tail=st.lists(st.integers(0, 2**32 - 1), max_size=200),
    block=st.sampled_from([1, 16, 64]),
    stride=st.sampled_from([1, 4]),
)
def test_keys_continued_from_an_earlier_prompt_are_the_whole_prompts(
    common, old_tail, new_tail, block, stride
):
    shared = np.arange(1, common + 1, dtype=TOKEN_DTYPE)
    old = np.concatenate([shared, np.array(old_tail, dtype=TOKEN_DTYPE)])
    new = np.concatenate([shared, np.array(new_tail, dtype=TOKEN_DTYPE)])
    old_keys = prefix_keys(old, block, stride, seed)
    keys, kept = identity.prefix_keys_after(new, block, stride, seed, old, old_keys)
    assert keys == prefix_keys(new, block, stride, seed)  # exact
    assert kept >= common // (block * stride)  # the shared strides were not hashed again
    assert all(a is b for a, b in zip(keys[:kept], old_keys, strict=False))
    compiled, identity._compiled = identity._compiled, None
    try:
        assert identity.prefix_keys_after(new, block, stride, seed, old, old_keys) == (keys, kept)
    finally:
        identity._compiled = compiled
