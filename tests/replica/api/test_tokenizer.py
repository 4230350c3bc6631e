import numpy as np
import pytest

from replica.api.model_tokenizer import load_tokenizer
from replica.api.tokenizer import ByteTokenizer, render_chat

tokenizer = ByteTokenizer()


def test_four_bytes_make_one_token_and_decode_round_trips():
    ids = tokenizer.encode("abcdefgh")
    assert len(ids) == 2
    assert ids[0] == int.from_bytes(b"abcd", "little")
    assert tokenizer.decode(ids) == "abcdefgh"


def test_a_partial_token_is_padded_with_spaces():
    assert tokenizer.decode(tokenizer.encode("abcde")) == "abcde   "


def test_appending_text_on_a_token_boundary_never_changes_earlier_tokens():
    head = tokenizer.encode("four")
    assert np.array_equal(tokenizer.encode("four more words")[: len(head)], head)


def test_chat_template_is_prefix_stable_across_turns():
    history = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi?"}]
    turn1 = tokenizer.apply_chat_template(history)
    history += [{"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye?"}]
    turn2 = tokenizer.apply_chat_template(history)
    assert len(turn2) > len(turn1)
    assert np.array_equal(turn2[: len(turn1)], turn1)


def test_chat_template_renders_roles_in_order():
    text = render_chat([{"role": "user", "content": "x"}]).decode()
    assert text.startswith("<|user|>") and text.rstrip().endswith("<|assistant|>")


def test_chat_template_rejects_unknown_roles_and_non_string_content():
    with pytest.raises(ValueError, match="unknown chat role"):
        render_chat([{"role": "wizard", "content": "x"}])
    with pytest.raises(ValueError, match="must be a string"):
        render_chat([{"role": "user", "content": 3}])  # type: ignore[dict-item]


def test_tokenizers_are_chosen_by_name_or_path():
    assert load_tokenizer("bytes4") == tokenizer
    with pytest.raises(ValueError, match="unknown tokenizer 'gpt2': give bytes4 or the path"):
        load_tokenizer("gpt2")
    with pytest.raises(ValueError, match="has its own chat template"):
        load_tokenizer("bytes4", chat_template="{{ messages }}")
