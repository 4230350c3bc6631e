"""Chat turns tokenized piece by piece: the same ids as the whole text, each earlier
message's piece encoded once, within a bound."""

import random

import pytest
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

from replica.api.model_tokenizer import HFTokenizer
from replica.api.token_cache import PieceCache

WORDS = ("cache", "prefix", "route", "replica", "token", "block", "engine", "batch", "queue")


def conversation(rng: random.Random, turns: int) -> list[dict[str, str]]:
    def text(words: int) -> str:
        spaces = ("  ", " ", "\n", " \n ", "")
        return "".join(rng.choice(WORDS) + rng.choice(spaces) for _ in range(words))

    messages = [{"role": "system", "content": text(300)}]
    for turn in range(turns):
        messages.append({"role": ("user", "assistant")[turn % 2], "content": text(40)})
    return messages


@pytest.fixture(scope="module")
def tiny(tiny_model) -> HFTokenizer:
    return HFTokenizer.load(tiny_model)


def test_every_turn_gets_the_ids_of_the_whole_text_and_encodes_only_its_new_pieces(tiny):
    assert tiny.pieces is not None
    cache, rng = tiny.pieces, random.Random(0)
    cache.clear()
    messages = conversation(rng, 12)
    for turn in range(2, len(messages) + 1):
        before = cache.stats()
        ids = tiny.apply_chat_template(messages[:turn])
        text = tiny.render(
            messages=messages[:turn], add_generation_prompt=True, **tiny.special_tokens
        )
        assert ids.tolist() == tiny.tokenizer.encode(text, add_special_tokens=False).ids
        after = cache.stats()
        if turn > 2:  # the system prompt and every earlier message were found, not encoded
            new = tiny.tokenizer.encode(messages[turn - 1]["content"], add_special_tokens=False)
            assert after.encoded_tokens - before.encoded_tokens <= len(new.ids) + 4
            assert after.hit_tokens - before.hit_tokens >= 300
    assert cache.stats().tokens <= cache.max_tokens and cache.stats().bytes > 0


def test_the_least_recently_used_pieces_go_first_within_the_bound(tiny):
    cache = PieceCache(tiny.tokenizer, max_tokens=60)
    for word in WORDS:
        cache.encode(f"<|eot_id|>{word} {word} {word}")
    kept = cache.stats()
    assert kept.tokens <= 60 and kept.pieces < len(WORDS)
    last = cache.encode(f"{WORDS[-1]} {WORDS[-1]} {WORDS[-1]}")  # the newest is still there
    assert cache.stats().hits == 1 and len(last) > 0
    cache.encode(f"{WORDS[0]} {WORDS[0]} {WORDS[0]}")  # the oldest was dropped
    assert cache.stats().misses == len(WORDS) + 1
    assert PieceCache.for_tokenizer(tiny.tokenizer, max_tokens=0) is None  # off


def tokenizer_with(pre_tokenizer, special: AddedToken) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE(unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizer
    tokenizer.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=200, special_tokens=["[UNK]"])
    rng = random.Random(1)
    tokenizer.train_from_iterator(
        (" ".join(rng.choice(WORDS) for _ in range(20)) for _ in range(200)), trainer
    )
    tokenizer.add_special_tokens([special])
    return tokenizer


def test_a_tokenizer_that_could_cut_differently_gets_no_cache():
    plain = AddedToken("<turn>", special=True, normalized=False)
    every_piece = pre_tokenizers.Metaspace(prepend_scheme="always")
    first_only = pre_tokenizers.Metaspace(prepend_scheme="first")
    stripping = AddedToken("<turn>", special=True, normalized=False, lstrip=True)
    cached = PieceCache.for_tokenizer(tokenizer_with(every_piece, plain))
    assert cached is not None  # each piece gets its space: cutting changes nothing
    text = "<turn>queue cache<turn> block  engine <turn>route"
    assert (
        cached.encode(text).tolist()
        == tokenizer_with(every_piece, plain).encode(text, add_special_tokens=False).ids
    )
    assert PieceCache.for_tokenizer(tokenizer_with(first_only, plain)) is None
    assert PieceCache.for_tokenizer(tokenizer_with(every_piece, stripping)) is None


def test_a_piece_is_found_only_by_the_scope_that_sent_it(tiny):
    """A tenant's chat tokenizes in the same time whatever another tenant sent: a long
    system prompt tenant A sent is encoded again for tenant B, and its ids are the same."""
    cache = PieceCache(tiny.tokenizer)
    system = " ".join(WORDS * 40)
    text = f"<|start_header_id|>system<|end_header_id|>{system}<|eot_id|>"
    ids = cache.encode(text, "tenant-a").tolist()
    encoded = cache.stats().encoded_tokens
    assert cache.encode(text, "tenant-b").tolist() == ids
    assert cache.stats().hits == 0 and cache.stats().encoded_tokens == 2 * encoded
    assert cache.encode(text, "tenant-a").tolist() == ids  # its own: found
    assert cache.stats().hit_tokens == encoded  # every piece of it
