"""A real model's tokenizer, a Hugging Face ``tokenizer.json`` and its chat template;
and ``load_tokenizer``, which names the simulated one or loads a model's.

With it the gateway tokenizes as a vLLM fleet serving that model does, so the token
ids it hashes are the ones the engines' ``BlockStored`` events carry, and precise
routing works in front of real engines. It does what vLLM's OpenAI server does:
a completion's prompt is encoded with the tokenizer's special tokens (a BOS, say); a
conversation is rendered with the model's Jinja chat template (in a sandbox, with
the names ``transformers`` gives it) and encoded without adding any, since the
template writes its own, piece by piece between its special tokens, each piece an
earlier turn sent found in a bounded cache (``replica/api/token_cache.py``). The
template is given what vLLM gives it beside the messages (``chat_variables``: tools,
documents, ``chat_template_kwargs``), in transformers' Jinja environment (its
``tojson``, which writes non-ASCII as is; ``strftime_now``; the ``generation`` tag), and
a conversation with tools is rendered by the model's ``tool_use`` template where it
ships one, as transformers picks it.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.nodes
import jinja2.parser
import numpy as np
from jinja2.ext import Extension, loopcontrols
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
    #: The model's ``tool_use`` template, for a conversation with tools (None: ``render``).
    render_tools: Callable[..., str] | None = None

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
        tool_use = _named(template).get("tool_use") if template else None
        return cls(
            name=str(path),
            tokenizer=tokenizer,
            eos_token_id=_eos_id(tokenizer, special.get("eos_token"), file),
            vocabulary=_ordinary_ids(tokenizer),
            render=_compile(_pick_template(template)) if template else None,
            special_tokens=special,
            pieces=PieceCache.for_tokenizer(tokenizer, cache_tokens),
            render_tools=_compile(tool_use) if tool_use else None,
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
        variables: Mapping[str, Any] | None = None,
    ) -> np.ndarray:
        """The conversation rendered by the model's template with ``variables`` (as
        transformers renders it: ``tools`` and ``documents`` none unless given, the special
        tokens unless ``variables`` name them), then encoded as is (its pieces cached
        apart for each ``cache_scope``)."""
        variables = variables or {}
        render = self._template(variables)
        context = {"tools": None, "documents": None, **self.special_tokens, **variables}
        context |= {"messages": [dict(m) for m in messages]}
        try:
            text = render(**context, add_generation_prompt=add_generation_prompt)
        except Exception as error:  # client data meets the template: vLLM answers 400
            raise ValueError(f"chat template: {error}") from None
        if self.pieces is not None:
            return self.pieces.encode(text, cache_scope)
        ids = self.tokenizer.encode(text, add_special_tokens=False).ids
        return np.asarray(ids, dtype=TOKEN_DTYPE)

    def _template(self, variables: Mapping[str, Any]) -> Callable[..., str]:
        """The model's ``tool_use`` template for a conversation with tools where it ships
        one (transformers' choice), else its template; raises if it has none."""
        if variables.get("tools") is not None and self.render_tools is not None:
            return self.render_tools
        if self.render is None:
            raise ValueError(
                f"tokenizer {self.name} has no chat template: give one (--chat-template FILE)"
            )
        return self.render


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
    try:
        return Path(chat_template).read_text()
    except OSError:  # no such file, or text too long to be a path's name
        pass
    if not any(c in chat_template for c in JINJA_CHARS):
        raise ValueError(
            f"chat template {chat_template!r} looks like a file's path, but "
            "there is no such file: give an existing .jinja file or the "
            "template's text"
        )
    return chat_template


def _named(template: str | list[dict[str, str]]) -> dict[str, str]:
    """Some models ship named templates (``default``, ``tool_use``); one is ``default``."""
    if isinstance(template, str):
        return {"default": template}
    return {entry["name"]: entry["template"] for entry in template}


def _pick_template(template: str | list[dict[str, str]]) -> str:
    """The template of a conversation without tools: ``default``."""
    named = _named(template)
    if "default" not in named:
        raise ValueError(f"no default chat template among {', '.join(named)}")
    return named["default"]


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    """transformers' ``tojson``: non-ASCII as is and no HTML escaping, unlike Jinja's own
    (a tool's description in another script renders as the engine renders it)."""
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(format: str) -> str:
    """The date some templates write (Llama 3.1's), read as transformers reads it."""
    return datetime.now().strftime(format)


class _Generation(Extension):
    """transformers' ``{% generation %}`` tag (it marks the assistant's tokens for
    training): its body renders as is."""

    tags = {"generation"}  # noqa: RUF012 (jinja2 types it as a set)

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        call = self.call_method("_render")
        return jinja2.nodes.CallBlock(call, [], [], body).set_lineno(lineno)

    def _render(self, caller: Callable[[], str]) -> str:
        return caller()


def _compile(template: str) -> Callable[..., str]:
    """The template compiled as ``transformers`` does: sandboxed, blocks trimmed, its
    filters, globals and tags."""
    environment = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, loopcontrols]
    )
    environment.globals["raise_exception"] = _raise_exception
    environment.globals["strftime_now"] = _strftime_now
    environment.filters["tojson"] = _tojson
    try:
        return environment.from_string(template).render
    except jinja2.TemplateSyntaxError as error:
        raise ValueError(f"chat template line {error.lineno}: {error.message}") from None
