"""A small randomly initialised Llama in a Hugging Face model folder: a real engine's
model that needs no download (``prefix-router tiny-model DIR``).

vLLM (its CPU build included) loads the folder as it loads any Llama: ``config.json``,
``model.safetensors`` (bfloat16, written here without torch), ``generation_config.json``,
and a byte-level BPE tokenizer trained here on the words the chat workload speaks
(``tokenizer.json``, ``tokenizer_config.json``, and the chat template in
``chat_template.jinja``, where transformers 5 writes it). Its answers are noise, but
its prefill and decode are a transformer's, its prefix cache is vLLM's, and the token
ids its KV events carry are the ones this tokenizer gives: what routing needs.

The same seed writes the same folder, byte for byte.
"""

from __future__ import annotations

import json
import struct
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from replica.api.tokenizer import WORDS

BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"
EOT, START_HEADER, END_HEADER = "<|eot_id|>", "<|start_header_id|>", "<|end_header_id|>"
SPECIAL_TOKENS = (BOS, EOS, EOT, START_HEADER, END_HEADER)
#: Llama 3.1's chat template, shortened: a BOS; a request's tools, if it has any, in a
#: turn of their own, each as JSON (as Llama 3.1 lists them); headed turns each ended by
#: <|eot_id|>; and after the generation prompt, Qwen 3's empty thinking when the request
#: turns thinking off (``chat_template_kwargs``' ``enable_thinking``), so that a real
#: engine's tests see tools and template arguments rendered. Every message renders on its
#: own, so turn N's text is a prefix of turn N+1's.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% if tools %}<|start_header_id|>system<|end_header_id|>\n\n"
    "You may call these tools:\n{% for tool in tools %}{{ tool | tojson(indent=4) }}\n"
    "{% endfor %}<|eot_id|>{% endif %}{% for message in messages %}"
    "<|start_header_id|>{{ message['role'] }}<|end_header_id|>\n\n"
    "{{ message['content'] }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
    "{% endif %}{% endif %}"
)
#: English words the workloads and tests write besides the syllables of WORDS.
ENGLISH_TEXT = (
    "You are a helpful careful assistant App Document What is the and of to in for on "
    "with as by an be this that it at from or KV cache prefix fleet replica router hello "
    "Hello question answer system user tool function developer 0 1 2 3 4 5 6 7 8 9 . , : ; "
    "? ! ' \" ( ) - + = / * # canary check probe"
)


@dataclass(frozen=True)
class TinyModelConfig:
    """A Llama-shaped model: 6.5 M parameters and 2 KiB of KV cache per token by default."""

    hidden_size: int = 256
    intermediate_size: int = 512
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    vocab_size: int = 8000
    max_position_embeddings: int = 8192
    seed: int = 0

    def __post_init__(self) -> None:
        if min(self.hidden_size, self.intermediate_size, self.num_layers, self.num_heads) < 1:
            raise ValueError(
                "hidden_size, intermediate_size, num_layers and num_heads must be positive"
            )
        if self.hidden_size % self.num_heads or self.num_heads % max(self.num_kv_heads, 1):
            raise ValueError("num_heads must divide hidden_size, num_kv_heads divide num_heads")
        if self.vocab_size < 512:
            raise ValueError(f"vocab_size must be at least 512, got {self.vocab_size}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def parameters(self) -> int:
        """Weights in all: embeddings and LM head, attention, MLP and norms."""
        hidden, kv = self.hidden_size, self.num_kv_heads * self.head_dim
        layer = 2 * hidden * hidden + 2 * hidden * kv + 3 * hidden * self.intermediate_size
        return 2 * self.vocab_size * hidden + self.num_layers * (layer + 2 * hidden) + hidden


def write_tiny_model(folder: Path, config: TinyModelConfig | None = None) -> Path:
    """Write the model folder (created if needed) and return it."""
    config = config or TinyModelConfig()
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer_ids = _write_tokenizer(folder, config)
    _write_json(folder / "config.json", _model_config(config, tokenizer_ids))
    stops = [tokenizer_ids[EOS], tokenizer_ids[EOT]]
    generation = {"bos_token_id": tokenizer_ids[BOS], "eos_token_id": stops}
    _write_json(folder / "generation_config.json", generation)
    words = _word_tokens(folder / "tokenizer.json", config.vocab_size)
    write_safetensors(folder / "model.safetensors", _weights(config, words))
    _write_json(folder / "prefix_router_tiny_model.json", asdict(config))
    return folder


# ----------------------------------------------------------------- the tokenizer


def _corpus(rng: np.random.Generator, sentences: int = 4000) -> list[str]:
    """Sentences of the syllable words the chat workload writes, and English words."""
    syllables = [int(w).to_bytes(4, "little").decode().strip() for w in WORDS]
    vocabulary = syllables + ENGLISH_TEXT.split()
    return [
        " ".join(vocabulary[i] for i in rng.integers(0, len(vocabulary), rng.integers(5, 40)))
        for _ in range(sentences)
    ]


def _write_tokenizer(folder: Path, config: TinyModelConfig) -> dict[str, Any]:
    """A byte-level BPE trained on :func:`_corpus`; returns the special tokens' ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=config.vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_corpus(np.random.default_rng(config.seed)), trainer)
    ids = {token: tokenizer.token_to_id(token) for token in SPECIAL_TOKENS}
    assert None not in ids.values()  # each was trained as a special token
    # A completion's prompt starts with the BOS, as Llama 3's tokenizer adds it.
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", special_tokens=[(BOS, ids[BOS])]
    )
    tokenizer.save(str(folder / "tokenizer.json"))
    _write_json(
        folder / "tokenizer_config.json",
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": BOS,
            "eos_token": EOT,
            "model_max_length": config.max_position_embeddings,
            "clean_up_tokenization_spaces": False,
        },
    )
    (folder / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    return ids


# ----------------------------------------------------------------- the model


def _model_config(config: TinyModelConfig, ids: dict[str, Any]) -> dict[str, object]:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
        "vocab_size": config.vocab_size,
        "max_position_embeddings": config.max_position_embeddings,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "bos_token_id": ids[BOS],
        "eos_token_id": ids[EOT],
        "torch_dtype": "bfloat16",
    }


def _word_tokens(tokenizer_file: Path, size: int) -> np.ndarray:
    """Whether each of ``size`` token ids is a whole word after a space (``Ġbal``): what
    the model may say. Ids the tokenizer does not use (its training stops once every word
    of the corpus is one token, short of ``size``) are not words: never said."""
    vocabulary = json.loads(tokenizer_file.read_text())["model"]["vocab"]
    words = np.zeros(size, dtype=bool)
    for token, token_id in vocabulary.items():
        if token_id < size:
            words[token_id] = token[:1] == "Ġ" and token[1:].isalpha() and token[1:].isascii()
    return words


def _weights(config: TinyModelConfig, words: np.ndarray) -> dict[str, np.ndarray]:
    """Random weights as a Llama checkpoint names them (normal, std 0.02; norms 1), and
    one hidden dimension kept for what it says: every embedding carries +1 there, which
    the layers' small outputs hardly move, so the final norm makes it about sqrt(hidden)
    (16); the LM head reads it as +1 for words and -1 for every other token (special
    tokens, byte fragments), which puts those e^32 times less likely. So a reply is
    always words that decode to text, one per token, as the simulated engine's are."""
    rng = np.random.default_rng(config.seed)
    hidden, inner, kv = config.hidden_size, config.intermediate_size, config.num_kv_heads
    kv_width = kv * config.head_dim

    def normal(*shape: int) -> np.ndarray:
        return rng.normal(0.0, 0.02, shape).astype(np.float32)

    embeddings = normal(config.vocab_size, hidden)
    embeddings[:, 0] = 1.0
    weights = {"model.embed_tokens.weight": embeddings}
    for layer in range(config.num_layers):
        prefix = f"model.layers.{layer}"
        weights |= {
            f"{prefix}.self_attn.q_proj.weight": normal(hidden, hidden),
            f"{prefix}.self_attn.k_proj.weight": normal(kv_width, hidden),
            f"{prefix}.self_attn.v_proj.weight": normal(kv_width, hidden),
            f"{prefix}.self_attn.o_proj.weight": normal(hidden, hidden),
            f"{prefix}.mlp.gate_proj.weight": normal(inner, hidden),
            f"{prefix}.mlp.up_proj.weight": normal(inner, hidden),
            f"{prefix}.mlp.down_proj.weight": normal(hidden, inner),
            f"{prefix}.input_layernorm.weight": np.ones(hidden, np.float32),
            f"{prefix}.post_attention_layernorm.weight": np.ones(hidden, np.float32),
        }
    weights["model.norm.weight"] = np.ones(hidden, np.float32)
    head = normal(config.vocab_size, hidden)
    head[:, 0] = np.where(words, 1.0, -1.0)
    weights["lm_head.weight"] = head
    return weights


def write_safetensors(path: Path, tensors: dict[str, np.ndarray]) -> None:
    """float32 arrays stored as bfloat16 in the safetensors format: an 8-byte header
    length, a JSON header of names, dtypes, shapes and offsets, then the raw data."""
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    blobs, offset = [], 0
    for name, array in tensors.items():
        data = _bfloat16(array).tobytes()
        header[name] = {
            "dtype": "BF16",
            "shape": list(array.shape),
            "data_offsets": [offset, offset + len(data)],
        }
        blobs.append(data)
        offset += len(data)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned
    with open(path, "wb") as out:
        out.write(struct.pack("<Q", len(text)))
        out.write(text)
        for blob in blobs:
            out.write(blob)


def _bfloat16(array: np.ndarray) -> np.ndarray:
    """The upper half of each float32, rounded to nearest even: bfloat16's bits."""
    bits = np.ascontiguousarray(array, dtype=np.float32).view(np.uint32)
    rounded = bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))
    return (rounded >> np.uint32(16)).astype("<u2")


def _write_json(path: Path, data: object) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n")


# ------------------------------------------------------------------ an adapter


def write_tiny_lora(folder: Path, model: Path, rank: int = 8, seed: int = 1) -> Path:
    """A LoRA adapter of the tiny model in PEFT's format (``adapter_config.json`` and
    ``adapter_model.safetensors``, on every attention projection), for vLLM's
    ``--enable-lora --lora-modules NAME=FOLDER``: made here, nothing downloaded."""
    config = TinyModelConfig(**json.loads((model / "prefix_router_tiny_model.json").read_text()))
    rng = np.random.default_rng(seed)
    hidden, kv = config.hidden_size, config.num_kv_heads * config.head_dim
    outputs = {"q_proj": hidden, "k_proj": kv, "v_proj": kv, "o_proj": hidden}
    tensors = {}
    for layer in range(config.num_layers):
        for name, width in outputs.items():
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{name}"
            tensors[f"{prefix}.lora_A.weight"] = rng.normal(0, 0.02, (rank, hidden))
            tensors[f"{prefix}.lora_B.weight"] = rng.normal(0, 0.02, (width, rank))
    folder.mkdir(parents=True, exist_ok=True)
    write_safetensors(folder / "adapter_model.safetensors", tensors)
    adapter = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": rank,
        "lora_alpha": 2 * rank,
        "lora_dropout": 0.0,
        "bias": "none",
        "target_modules": list(outputs),
        "base_model_name_or_path": str(model),
    }
    _write_json(folder / "adapter_config.json", adapter)
    return folder
