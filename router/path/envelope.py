"""Stage 1 of the request path: read the envelope, what the gateway needs of a request
before routing it, and no more.

The gateway is never stricter than its backends: it refuses only what it cannot
route (a body over the limits, a body that is not a JSON object, a model no replica
serves: ``Gateway.resolve``) and forwards everything else as the client wrote it, for the backend to
accept or refuse as it would without a router. What it needs for routing it reads
leniently: the prompt (the first of a batch), rendered by the replicas' chat
template with what vLLM gives it beside the messages (tools, documents, template
arguments); a request whose prompt it cannot read is routed by load alone.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import msgspec
import numpy as np
from fastapi import Request

from replica.api import openai as api
from replica.api.chat_variables import chat_variables
from replica.api.tokenizer import Tokenizer


class Inbound(Protocol):
    """A request as its HTTP server hands it over: its headers (names in lower case),
    and its body, read up to a limit."""

    @property
    def headers(self) -> Mapping[str, str]: ...

    async def body(self, limit: int) -> bytes:
        """The body; ``api.Rejected`` (413) once it is over ``limit`` bytes."""
        ...


class AsgiInbound:
    """An ASGI request (starlette's), read as it streams in."""

    def __init__(self, request: Request) -> None:
        self.request, self.headers = request, request.headers

    async def body(self, limit: int) -> bytes:
        return await read_capped(self.request, limit)


@dataclass(frozen=True)
class Envelope:
    """A request as it came, and the fields of its body that the request path needs."""

    body: dict[str, Any]
    stream: bool
    include_usage: bool
    cache_salt: str | None
    #: The body as the client wrote it (forwarded as it came), the endpoint it was sent
    #: to, its headers, and when it arrived (``time.perf_counter``).
    raw: bytes = field(default=b"", repr=False)
    path: str = "/v1/completions"
    headers: Mapping[str, str] = field(default_factory=dict, repr=False)
    received: float = 0.0
    #: The prompt routed by (the first of a batch); ``None`` if it cannot be read.
    prompt: np.ndarray | None = field(default=None, repr=False)

    @classmethod
    def of(cls, body: dict[str, Any], **request: Any) -> Envelope:
        """The envelope of ``body``; ``request``: the other fields, as they came."""
        options = body.get("stream_options")
        include_usage = isinstance(options, dict) and options.get("include_usage") is True
        salt = body.get("cache_salt")
        stream = body.get("stream") is True
        return cls(body, stream, include_usage, salt if isinstance(salt, str) else None, **request)


@dataclass(frozen=True)
class Limits:
    """What the gateway reads of a request: its body's bytes, its prompt's tokens (the
    flag's, or the longest the backends serve)."""

    max_request_bytes: int
    max_prompt_tokens: int


#: The tokenizer of the model a request names (its body's ``model``, as it came).
TokenizerOf = Callable[[object], Tokenizer]


async def read(
    request: Inbound,
    path: str,
    chat: bool,
    limits: Limits,
    tokenizer_of: TokenizerOf,
    tenant: str | None = None,
) -> Envelope:
    """Read a completion request: 413 over the limits, 400 if its body is not a JSON
    object; its prompt tokenized with its model's replicas' tokenizer and chat template
    (from ``tenant``'s own cache of conversations' pieces)."""
    received = time.perf_counter()
    raw, body = parse_body(await request.body(limits.max_request_bytes))
    prompts = request_prompts(body, chat, tokenizer_of(body.get("model")), tenant)
    if prompts is not None:
        check_length(prompts, limits.max_prompt_tokens, "messages" if chat else "prompt")
    prompt = prompts[0] if prompts else None
    return Envelope.of(
        body, raw=raw, path=path, headers=request.headers, received=received, prompt=prompt
    )


async def read_capped(request: Request, limit: int) -> bytes:
    """The request body, refused with 413 as soon as it exceeds ``limit`` bytes."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_large(limit)
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise too_large(limit)
    return bytes(body)


def too_large(limit: int) -> api.Rejected:
    return api.Rejected(f"the request body is over the limit of {limit} bytes", 413)


#: JSON read as Python's ``json`` reads it (duplicate keys: the last wins), in a
#: fraction of its time.
_decode = msgspec.json.Decoder().decode


def parse_body(raw: bytes) -> tuple[bytes, dict[str, Any]]:
    """The raw body (forwarded as it came) and its JSON object. What msgspec refuses
    and Python's ``json`` (vLLM's reader) takes, NaN or a lone surrogate, is read by
    ``json``: the gateway is never stricter than the engines."""
    try:
        body = _decode(raw)
    except msgspec.MsgspecError:
        try:
            body = json.loads(raw)
        except ValueError as error:
            raise api.Rejected(f"invalid JSON: {error}", 400) from None
    if not isinstance(body, dict):
        raise api.Rejected("the request body must be a JSON object", 400)
    return raw, body


def request_prompts(
    body: dict[str, Any], chat: bool, tokenizer: Tokenizer, tenant: str | None = None
) -> list[np.ndarray] | None:
    """The request's prompts: the conversation through the chat template, or every
    prompt of a batch (the first is routed by, each is checked against the limit);
    ``None`` if they cannot be read (the backend will say why)."""
    try:
        if chat:
            messages = api.chat_prompt_messages(body["messages"])
            extra = chat_variables(body)  # tools, documents, ...: vLLM renders them too
            return [tokenizer.apply_chat_template(messages, cache_scope=tenant, variables=extra)]
        return api.prompt_token_ids(body["prompt"], tokenizer)
    except (KeyError, ValueError):  # pydantic's and Rejected are ValueErrors too
        return None


def check_length(prompts: list[np.ndarray], limit: int, field: str) -> None:
    for index, prompt in enumerate(prompts):
        if len(prompt) > limit:
            which = f"prompt {index} of the batch" if len(prompts) > 1 else "the prompt"
            raise api.Rejected(
                f"{which} is {len(prompt)} tokens, over the limit of {limit}", 413, field
            )
