"""The OpenAI-compatible request and response shapes, shared by replica and gateway.

Requests are validated with pydantic: wrong types, missing fields and out-of-range
values become a 400 naming the problem, as OpenAI and vLLM answer.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

import numpy as np
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from replica.api.tokenizer import TOKEN_DTYPE, ByteTokenizer

#: Token ids are 32-bit (see replica.tokenizer).
MAX_TOKEN_ID = 2**32 - 1
#: OpenAI's default for /v1/completions; chat requests without a limit get more.
DEFAULT_COMPLETION_TOKENS = 16
DEFAULT_CHAT_TOKENS = 256


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Common(BaseModel):
    model_config = ConfigDict(extra="allow")  # unknown sampling fields are accepted and ignored

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1, le=1_000_000)
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    #: vLLM's per-request salt: narrows cache sharing to requests with the same salt.
    cache_salt: str | None = Field(default=None, max_length=256)
    n: int = Field(default=1, ge=1, le=1)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Common):
    prompt: str | list[int] = Field(min_length=1)

    def token_limit(self) -> int:
        return self.max_tokens or DEFAULT_COMPLETION_TOKENS

    def token_ids(self, tokenizer: ByteTokenizer) -> np.ndarray | None:
        """The prompt as token ids (text is tokenized); ``None`` if an id is out of range."""
        if isinstance(self.prompt, str):
            return tokenizer.encode(self.prompt)
        if not all(0 <= t <= MAX_TOKEN_ID for t in self.prompt):
            return None
        return np.asarray(self.prompt, dtype=TOKEN_DTYPE)


class ChatMessage(BaseModel):
    role: Literal["system", "user", "assistant", "tool"]
    content: str


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=1_000_000)

    def token_limit(self) -> int:
        return self.max_completion_tokens or self.max_tokens or DEFAULT_CHAT_TOKENS


class Rejected(Exception):
    """A request refused with a 4xx naming the problem (``param``: the field)."""

    def __init__(self, message: str, status: int = 400, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.param = param

    def response(self) -> JSONResponse:
        return JSONResponse(error_body(str(self), self.status, self.param), self.status)


def bad_token_ids() -> JSONResponse:
    return JSONResponse(error_body("prompt token ids must lie in [0, 2**32)", 400, "prompt"), 400)


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def completion_body(
    request_id: str, model: str, text: str, finish_reason: str | None, usage_: dict | None
) -> dict[str, Any]:
    return {
        "id": request_id,
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}],
        "usage": usage_,
    }


def chat_body(
    request_id: str, model: str, text: str, finish_reason: str | None, usage_: dict | None
) -> dict[str, Any]:
    return {
        "id": request_id,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": None,
                "finish_reason": finish_reason,
            }
        ],
        "usage": usage_,
    }


def completion_chunk(
    request_id: str, model: str, text: str, finish_reason: str | None
) -> dict[str, Any]:
    body = completion_body(request_id, model, text, finish_reason, None)
    del body["usage"]
    return body


def chat_chunk(
    request_id: str, model: str, delta: dict[str, str], finish_reason: str | None
) -> dict[str, Any]:
    return {
        "id": request_id,
        "object": "chat.completion.chunk",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}],
    }


def usage_chunk(request_id: str, model: str, kind: str, usage_: dict) -> dict[str, Any]:
    return {
        "id": request_id,
        "object": kind,
        "created": int(time.time()),
        "model": model,
        "choices": [],
        "usage": usage_,
    }


def error_body(message: str, status: int, param: str | None = None) -> dict[str, Any]:
    kind = {
        400: "BadRequestError",
        404: "NotFoundError",
        401: "AuthenticationError",
        403: "PermissionDeniedError",
        409: "ConflictError",
        413: "RequestTooLarge",
        429: "RateLimitError",
    }
    return {
        "error": {
            "message": message,
            "type": kind.get(status, "ServerError" if status >= 500 else "BadRequestError"),
            "param": param,
            "code": status,
        }
    }


def bad_request(error: RequestValidationError) -> JSONResponse:
    """Pydantic's first complaint as one OpenAI-style 400 naming the field."""
    first = error.errors()[0] if error.errors() else {}
    if first.get("type") == "json_invalid":
        detail = first.get("ctx", {}).get("error", "")
        return JSONResponse(error_body(f"invalid JSON: {detail}", 400), status_code=400)
    where = ".".join(str(part) for part in first.get("loc", ()) if _is_field(part))
    message = f"{where}: {first.get('msg', 'invalid value')}" if where else "invalid request body"
    return JSONResponse(error_body(message, 400, where or None), status_code=400)


def _is_field(part: object) -> bool:
    """Field names and list indexes, not 'body' or the branch names of a union type."""
    if isinstance(part, int):
        return True
    text = str(part)
    return text != "body" and "[" not in text and text not in {"str", "int", "float", "bool"}
