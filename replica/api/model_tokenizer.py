"""A real model's tokenizer, a Hugging Face ``tokenizer.json`` and its chat template;
and ``load_tokenizer``, which names the simulated one or loads a model's.

With it the gateway tokenizes as a vLLM fleet serving that model does, so the token
ids it hashes are the ones the engines' ``BlockStored`` events carry, and precise
routing works in front of real engines. It does what vLLM's OpenAI server does:
a completion's prompt is encoded with the tokenizer's special tokens (a BOS, say); a
conversation is rendered with the model's Jinja chat template (in a sandbox, with
the names ``transformers`` gives it) and encoded without adding any, since the
template writes its own, piece by piece between its special tokens, each piece an
earlier turn sent found in a bounded cache (``replica/api/token_cache.py``).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jinja2
import numpy as np
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as RustTokenizer

from replica.api.token_cache import DEFAULT_CACHE_TOKENS, PieceCache
from replica.api.tokenizer import DEFAULT_TOKENIZER, TOKEN_DTYPE, ByteTokenizer, Message, Tokenizer

TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILE = "tokenizer_config.json"
#: Where transformers 5 saves a model's chat template (it wins over the config's, as there).
TEMPLATE_FILE = "chat_template.jinja"


@dataclass(frozen=True, eq=False)
class HFTokenizer:
    """A ``tokenizers`` tokenizer with its special tokens and chat template."""

    name: str
    tokenizer: RustTokenizer
    eos_token_id: int
    #: Ids a simulated engine may generate: every token but the special ones.
    vocabulary: Sequence[int]
    render: Callable[..., str] | None  # the compiled chat template, if there is one
    special_tokens: Mapping[str, str]  # bos_token, eos_token: what the template may name
    #: The ids of pieces between special tokens that earlier conversations sent (None:
    #: off, or a tokenizer whose pieces are not encoded independently).
    pieces: PieceCache | None = None

    @classmethod
    def load(
        cls, path: Path, chat_template: str = "", cache_tokens: int = DEFAULT_CACHE_TOKENS
    ) -> HFTokenizer:
        """From a ``tokenizer.json`` or a folder that holds it (and, beside it, the
        ``tokenizer_config.json`` naming its special tokens and chat template, or the
        template in ``chat_template.jinja``, where transformers 5 writes it). Chats'
        pieces are cached up to ``cache_tokens`` tokens (0: not at all)."""
        folder = path if path.is_dir() else path.parent
        file = path / TOKENIZER_FILE if path.is_dir() else path
        if not file.is_file():
            raise ValueError(f"no {TOKENIZER_FILE} in {path}")
        tokenizer = RustTokenizer.from_file(str(file))
        config = _read_config(folder / CONFIG_FILE)
        special = {
            key: _token_text(config[key]) for key in ("bos_token", "eos_token") if config.get(key)
        }
        saved = folder / TEMPLATE_FILE
        template = (
            _template_text(chat_template)
            if chat_template
            else saved.read_text()
            if saved.is_file()
            else config.get("chat_template")
        )
        return cls(
            name=str(path),
            tokenizer=tokenizer,
            eos_token_id=_eos_id(tokenizer, special.get("eos_token"), file),
            vocabulary=_ordinary_ids(tokenizer),
            render=_compile(_pick_template(template)) if template else None,
            special_tokens=special,
            pieces=PieceCache.for_tokenizer(tokenizer, cache_tokens),
        )

    def encode(self, text: str) -> np.ndarray:
        """A completion prompt's ids, with the special tokens the tokenizer adds (BOS)."""
        return np.asarray(self.tokenizer.encode(text).ids, dtype=TOKEN_DTYPE)

    def decode(self, token_ids: Sequence[int] | np.ndarray) -> str:
        return self.tokenizer.decode([int(t) for t in token_ids], skip_special_tokens=True)

    def apply_chat_template(
        self,
        messages: Sequence[Message],
        add_generation_prompt: bool = True,
        cache_scope: str | None = None,
    ) -> np.ndarray:
        """The conversation rendered by the model's template, then encoded as is (its
        pieces cached apart for each ``cache_scope``)."""
        if self.render is None:
            raise ValueError(
                f"tokenizer {self.name} has no chat template: give one (--chat-template FILE)"
            )
        try:
            text = self.render(
                messages=[dict(m) for m in messages],
                add_generation_prompt=add_generation_prompt,
                **self.special_tokens,
            )
        except jinja2.TemplateError as error:
            raise ValueError(f"chat template: {error}") from None
        if self.pieces is not None:
            return self.pieces.encode(text, cache_scope)
        ids = self.tokenizer.encode(text, add_special_tokens=False).ids
        return np.asarray(ids, dtype=TOKEN_DTYPE)


def load_tokenizer(
    name: str = DEFAULT_TOKENIZER, chat_template: str = "", cache_tokens: int = DEFAULT_CACHE_TOKENS
) -> Tokenizer:
    """``bytes4`` (the simulated model's), or a Hugging Face tokenizer: a ``tokenizer.json``
    or a folder holding one (and ``tokenizer_config.json`` with its chat template, as a
    model's repository does). ``chat_template``: a Jinja file or text that replaces it;
    ``cache_tokens``: the bound of its cache of chats' pieces (0: none)."""
    if name == DEFAULT_TOKENIZER:
        if chat_template:
            raise ValueError("the bytes4 tokenizer has its own chat template; give a model's")
        return ByteTokenizer()
    if not Path(name).exists():
        raise ValueError(
            f"unknown tokenizer {name!r}: give {DEFAULT_TOKENIZER} or the path of a "
            "Hugging Face tokenizer.json or of the folder that holds it"
        )
    return HFTokenizer.load(Path(name), chat_template, cache_tokens)


def _read_config(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    config = json.loads(path.read_text())
    if not isinstance(config, dict):
        raise ValueError(f"{path} is not a JSON object")
    return config


def _token_text(token: str | Mapping[str, Any]) -> str:
    """A special token as ``tokenizer_config.json`` writes it: text, or an AddedToken map."""
    return token if isinstance(token, str) else str(token["content"])


def _eos_id(tokenizer: RustTokenizer, eos: str | None, file: Path) -> int:
    token_id = tokenizer.token_to_id(eos) if eos else None
    if token_id is None:
        raise ValueError(f"{file}: no eos_token in {CONFIG_FILE} that the tokenizer knows")
    return int(token_id)


def _ordinary_ids(tokenizer: RustTokenizer) -> tuple[int, ...]:
    special = {i for i, token in tokenizer.get_added_tokens_decoder().items() if token.special}
    return tuple(i for i in range(tokenizer.get_vocab_size()) if i not in special)


#: A ``--chat-template`` with none of these is a file's path, as vLLM judges it.
JINJA_CHARS = "{}\n"


def _template_text(chat_template: str) -> str:
    """``--chat-template``: a file's path or the template itself, as vLLM takes it (a
    path that does not open is an error, not a template that renders the path)."""
    path = Path(chat_template)
    if path.is_file():
        return path.read_text()
    if not any(c in chat_template for c in JINJA_CHARS):
        raise ValueError(
            f"chat template {chat_template!r} looks like a file's path, but "
            "there is no such file: give an existing .jinja file or the "
            "template's text"
        )
    return chat_template


def _pick_template(template: str | list[dict[str, str]]) -> str:
    """Some models ship named templates (``default``, ``tool_use``): chat uses ``default``."""
    if isinstance(template, str):
        return template
    named = {entry["name"]: entry["template"] for entry in template}
    if "default" not in named:
        raise ValueError(f"no default chat template among {', '.join(named)}")
    return named["default"]


def _raise_exception(message: str) -> None:
    raise ValueError(f"chat template: {message}")


def _compile(template: str) -> Callable[..., str]:
    """The template compiled as ``transformers`` does: sandboxed, blocks trimmed."""
    environment = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]
    )
    environment.globals["raise_exception"] = _raise_exception
    environment.filters["tojson"] = lambda value, indent=None: json.dumps(value, indent=indent)
    try:
        return environment.from_string(template).render
    except jinja2.TemplateSyntaxError as error:
        raise ValueError(f"chat template line {error.lineno}: {error.message}") from None
