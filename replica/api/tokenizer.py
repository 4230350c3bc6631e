"""Tokens for a simulated model: fast, deterministic and prefix-stable.

Every tokenizer the project uses has the shape of :class:`Tokenizer`; a real model's
is in ``model_tokenizer``. The default tokenizer treats every 4 bytes of UTF-8 as one
token (about the four characters per token of real BPE). Tokenizing is a
``numpy.frombuffer``, so the router and the replica always agree on token ids and
block boundaries.

The chat template pads every rendered piece to a 4-byte boundary, so the tokens of
turn N are an exact prefix of the tokens of turn N+1: the property a prefix cache
needs from a real chat template.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

TOKEN_DTYPE = np.dtype("<u4")
BYTES_PER_TOKEN = TOKEN_DTYPE.itemsize
PAD_BYTE = b" "

Message = Mapping[str, str]

#: The tokenizer of the simulated model (``load_tokenizer``'s default).
DEFAULT_TOKENIZER = "bytes4"


class Tokenizer(Protocol):
    """What the gateway and the replicas need of a tokenizer: the token ids of a prompt
    and of a rendered conversation, text back from ids, the id that ends a reply, and
    the ids a simulated engine may generate."""

    @property
    def name(self) -> str: ...

    @property
    def eos_token_id(self) -> int: ...

    @property
    def vocabulary(self) -> Sequence[int]: ...

    def encode(self, text: str) -> np.ndarray: ...

    def decode(self, token_ids: Sequence[int] | np.ndarray) -> str: ...

    def apply_chat_template(
        self,
        messages: Sequence[Message],
        add_generation_prompt: bool = True,
        cache_scope: str | None = None,
        variables: Mapping[str, Any] | None = None,
    ) -> np.ndarray:
        """The conversation's ids. ``cache_scope``: whose cache of earlier pieces the
        encoding may use (a tenant's: a piece only another scope sent is encoded again,
        so its timing tells nothing of what others sent). ``variables``: what the
        template is given beside the messages, as vLLM gives it (the request's tools,
        documents, ``chat_template_kwargs``: ``replica.api.chat_variables``)."""
        ...


# The toy model's vocabulary: consonant-vowel-consonant words and a space, so that a
# reply decodes to readable, 4-byte tokens.
_VOWELS, _CONSONANTS = "aeiou", "bcdfghjklmnpqrstvwxyz"
WORDS = tuple(
    int.from_bytes(f"{a}{v}{b} ".encode(), "little")
    for a in _CONSONANTS
    for v in _VOWELS
    for b in _CONSONANTS
)


def _pad(data: bytes) -> bytes:
    """Pad to a whole number of tokens, so what follows starts on a token boundary."""
    return data + PAD_BYTE * (-len(data) % BYTES_PER_TOKEN)


@dataclass(frozen=True)
class ByteTokenizer:
    """One token per 4 bytes of UTF-8; token ids are those bytes as a little-endian uint32."""

    name: str = "bytes4"
    #: Token id that ends generation unless the request ignores EOS: four NUL bytes,
    #: which no UTF-8 text of ours ever contains.
    eos_token_id: int = 0
    vocabulary: Sequence[int] = WORDS

    def encode(self, text: str) -> np.ndarray:
        """Token ids of ``text``; a trailing partial token is padded with spaces."""
        return np.frombuffer(_pad(text.encode("utf-8")), dtype=TOKEN_DTYPE)

    def decode(self, token_ids: Sequence[int] | np.ndarray) -> str:
        ids = np.asarray(token_ids, dtype=TOKEN_DTYPE)
        ids = ids[ids != self.eos_token_id]
        return ids.tobytes().decode("utf-8", errors="replace")

    def apply_chat_template(
        self,
        messages: Sequence[Message],
        add_generation_prompt: bool = True,
        cache_scope: str | None = None,
        variables: Mapping[str, Any] | None = None,
    ) -> np.ndarray:
        """Token ids of the rendered conversation (see :func:`render_chat`); no cache,
        so no scope. The simulated model's template renders the messages alone, as a
        model's template without a tools section does: ``variables`` change nothing."""
        return np.frombuffer(render_chat(messages, add_generation_prompt), dtype=TOKEN_DTYPE)


ROLES = ("system", "developer", "user", "assistant", "tool", "function")


def _header(role: str) -> bytes:
    return _pad(f"<|{role}|>\n".encode())


_END = _pad(b"<|end|>\n")


def render_message(message: Message) -> bytes:
    """One message as bytes: a padded header, the padded content, a padded end marker.

    The header is padded on its own so that the generation prompt (the assistant
    header alone) is a token-exact prefix of the same turn rendered with its reply.
    """
    role = message.get("role")
    if role not in ROLES:
        raise ValueError(f"unknown chat role {role!r}; expected one of {', '.join(ROLES)}")
    content = message.get("content", "")
    if not isinstance(content, str):
        raise ValueError(f"message content must be a string, got {type(content).__name__}")
    return _header(role) + _pad(content.encode("utf-8")) + _END


def render_chat(messages: Sequence[Message], add_generation_prompt: bool = True) -> bytes:
    """The chat template: messages in order, then the assistant header to prompt a reply."""
    rendered = b"".join(render_message(m) for m in messages)
    return rendered + _header("assistant") if add_generation_prompt else rendered
