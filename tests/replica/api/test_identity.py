import numpy as np
import xxhash

from replica.api.identity import BlockHasher, block_hashes, identity_seed
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
