"""`prefix-router tiny-model`: a Llama folder that needs no download, read back as its
readers read it (the safetensors layout, the tokenizer and its chat template)."""

import json
import struct

import numpy as np
import pytest

from prefix_router.cli import main
from replica.api.model_tokenizer import load_tokenizer
from replica.tiny_model import (
    BOS,
    EOT,
    TinyModelConfig,
    _bfloat16,
    write_safetensors,
    write_tiny_model,
)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("tiny"))


def read_safetensors(path):
    """The header and the tensors, as any safetensors reader finds them."""
    data = path.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + length])
    body = data[8 + length :]
    tensors = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        start, end = entry["data_offsets"]
        bits = np.frombuffer(body[start:end], dtype="<u2").astype(np.uint32) << 16
        tensors[name] = bits.view(np.float32).reshape(entry["shape"])
    return header, tensors


def test_the_folder_is_a_llama_checkpoint_with_every_weight_in_bfloat16(folder):
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert (config["hidden_size"], config["num_hidden_layers"], config["vocab_size"]) == (
        256,
        4,
        8000,
    )
    header, tensors = read_safetensors(folder / "model.safetensors")
    assert {entry["dtype"] for name, entry in header.items() if name != "__metadata__"} == {"BF16"}
    assert sum(t.size for t in tensors.values()) == TinyModelConfig().parameters == 6_457_600
    assert tensors["model.layers.0.self_attn.k_proj.weight"].shape == (2 * 64, 256)
    assert np.all(tensors["model.norm.weight"] == 1.0)
    head = tensors["lm_head.weight"]
    assert 0.015 < float(np.std(head[:, 1:])) < 0.025  # initialised as HF does
    # ...but for the dimension that says what it may say: whole words, never special
    # tokens, byte fragments or ids the tokenizer leaves unused.
    tokenizer = load_tokenizer(str(folder))
    says = np.flatnonzero(head[:, 0] > 0)
    assert np.all(tensors["model.embed_tokens.weight"][:, 0] == 1.0)
    assert set(head[:, 0].tolist()) == {1.0, -1.0} and len(says) > 2000
    texts = [tokenizer.decode([int(t)]) for t in says]
    assert all(text.startswith(" ") and text[1:].isalpha() for text in texts)
    assert tokenizer.tokenizer.token_to_id(BOS) not in says
    unused = range(tokenizer.tokenizer.get_vocab_size(), 8000)  # past the trained tokens
    assert unused and not set(unused) & set(says.tolist())


def test_bfloat16_rounds_to_nearest_even():
    values = np.array([1.0, -2.5, 1 + 2**-8, 1 + 3 * 2**-9, 3.0e38], dtype=np.float32)
    back = (_bfloat16(values).astype(np.uint32) << 16).view(np.float32)
    assert back.tolist()[:2] == [1.0, -2.5]
    assert back[2] == 1.0  # a tie rounds to the even mantissa
    assert back[3] == 1 + 2**-7  # above the half way: up
    assert np.isfinite(back[4])


def test_the_tokenizer_and_the_template_transformers_5_writes_are_read_back(folder):
    assert not json.loads((folder / "tokenizer_config.json").read_text()).get("chat_template")
    tokenizer = load_tokenizer(str(folder))  # the template from chat_template.jinja
    bos = tokenizer.tokenizer.token_to_id(BOS)
    ids = tokenizer.encode("bal kes App 1. hello")
    assert ids[0] == bos and len(ids) < 10  # the workload's words are whole tokens
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "bal kes"}])
    text = tokenizer.tokenizer.decode(chat.tolist(), skip_special_tokens=False)
    assert text == (
        f"{BOS}<|start_header_id|>user<|end_header_id|>\n\nbal kes{EOT}"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    assert tokenizer.eos_token_id == tokenizer.tokenizer.token_to_id(EOT)


def test_the_same_seed_writes_the_same_folder_and_another_seed_another(tmp_path):
    config = TinyModelConfig(hidden_size=64, intermediate_size=128, num_layers=1, vocab_size=600)
    first = write_tiny_model(tmp_path / "a", config)
    again = write_tiny_model(tmp_path / "b", config)
    other = write_tiny_model(tmp_path / "c", TinyModelConfig(**{**config.__dict__, "seed": 1}))
    files = sorted(p.name for p in first.iterdir())
    assert files == sorted(p.name for p in again.iterdir())
    for name in files:
        assert (first / name).read_bytes() == (again / name).read_bytes(), name
    assert (first / "model.safetensors").read_bytes() != (other / "model.safetensors").read_bytes()


def test_safetensors_data_starts_8_byte_aligned(tmp_path):
    write_safetensors(tmp_path / "w.safetensors", {"x": np.ones((3,), np.float32)})
    (length,) = struct.unpack("<Q", (tmp_path / "w.safetensors").read_bytes()[:8])
    assert length % 8 == 0


def test_the_command_writes_a_folder_and_refuses_a_bad_shape(tmp_path, capsys):
    assert main(["tiny-model", str(tmp_path / "m"), "--num-layers", "2"]) == 0
    assert json.loads((tmp_path / "m" / "config.json").read_text())["num_hidden_layers"] == 2
    assert "prefix-router serve --engine vllm --model" in capsys.readouterr().out
    assert main(["tiny-model", str(tmp_path / "n"), "--num-heads", "3"]) == 2
    assert "num_heads must divide hidden_size" in capsys.readouterr().err
