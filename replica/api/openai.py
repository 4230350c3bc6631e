"""The OpenAI-compatible request and response shapes, shared by replica and gateway.

Requests are validated with pydantic: wrong types, missing fields and out-of-range
values become a 400 naming the problem, as OpenAI and vLLM answer.
"""

from __future__ import annotations

import json
import os
from typing import Any, Literal

import numpy as np
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, field_validator, model_validator

from replica.api.chat_variables import chat_variables, tokenize_variables
from replica.api.tokenizer import TOKEN_DTYPE, Tokenizer

#: Token ids are 32-bit (see replica.tokenizer).
MAX_TOKEN_ID = 2**32 - 1
#: OpenAI's default for /v1/completions; chat requests without a limit get more.
DEFAULT_COMPLETION_TOKENS = 16
DEFAULT_CHAT_TOKENS = 256
#: vLLM's default ``max_logprobs``: the most alternatives a token's logprobs may list.
MAX_LOGPROBS = 20
#: Content part types a text model reads; vLLM refuses the others for such a model.
TEXT_PARTS = ("text", "input_text")


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Sampling(BaseModel):
    """What completions and chat share: the sampling parameters, with vLLM's ranges.

    Fields the simulated model has nothing to do with (``user``, ``response_format``,
    penalties, ...) are accepted, checked as vLLM checks them, and ignored (a chat's
    ``tools`` only change its prompt, where the chat template renders them).
    """

    model_config = ConfigDict(extra="allow")  # unknown fields are accepted and ignored

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1, le=1_000_000)
    min_tokens: int = Field(default=0, ge=0)
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    #: vLLM's per-request salt: narrows cache sharing to requests with the same salt.
    cache_salt: str | None = Field(default=None, max_length=256)
    n: int = Field(default=1, ge=1, le=128)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=-1)
    min_p: float | None = Field(default=None, ge=0, le=1)
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    repetition_penalty: float | None = Field(default=None, gt=0)
    #: Each choice samples from its own seed derived from this one: the same request
    #: with the same seed gives the same answer.
    seed: int | None = None
    stop: str | list[str] | None = None
    user: str | None = None
    response_format: dict[str, Any] | None = None
    #: Token id (as text) to a bias added to its logit, clamped to [-100, 100] as vLLM
    #: clamps it.
    logit_bias: dict[str, float] | None = None
    #: vLLM's P/D protocol (its NIXL connector's shape): ``do_remote_decode`` to prefill
    #: for a decode replica, ``do_remote_prefill`` and the peer to pull from
    #: (replica/peers.py).
    kv_transfer_params: dict[str, Any] | None = None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def stop_strings(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @field_validator("logit_bias")
    @classmethod
    def _bias_token_ids(cls, bias: dict[str, float] | None) -> dict[str, float] | None:
        wrong = [k for k in bias or {} if not k.isdigit() or int(k) > MAX_TOKEN_ID]
        if wrong:
            raise ValueError(f"token_id(s) {wrong} in logit_bias are not token ids in [0, 2**32)")
        return bias

    @property
    def token_bias(self) -> tuple[tuple[int, float], ...]:
        return tuple((int(token), bias) for token, bias in (self.logit_bias or {}).items())

    @model_validator(mode="after")
    def _vllm_rules(self) -> _Sampling:
        if self.temperature == 0 and self.n > 1:
            raise ValueError(f"n must be 1 when using greedy sampling, got {self.n}")
        if any(not stop for stop in self.stop_strings):
            raise ValueError("stop cannot contain an empty string")
        limit = self.token_limit()
        if self.min_tokens > limit:
            raise ValueError(
                f"min_tokens must be less than or equal to max_tokens={limit}, got "
                f"{self.min_tokens}."
            )
        return self

    def token_limit(self) -> int:
        return self.max_tokens or DEFAULT_COMPLETION_TOKENS


class CompletionRequest(_Sampling):
    """``prompt``: text, token ids, or a batch of either (one choice per prompt)."""

    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    suffix: str | None = None

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, suffix: str | None) -> str | None:
        if suffix is not None:  # vLLM's answer for a model without fill-in-the-middle
            raise ValueError("suffix is only supported for models with FIM completion rendering")
        return suffix

    @model_validator(mode="after")
    def _echo_without_logprobs(self) -> CompletionRequest:
        if self.echo and self.logprobs is not None:  # vLLM adds the prompt's logprobs
            raise ValueError(
                "echo with logprobs is not supported by the simulated model "
                "(it has no logprobs for prompt tokens)"
            )
        return self

    def prompts(self, tokenizer: Tokenizer) -> list[np.ndarray]:
        return prompt_token_ids(self.prompt, tokenizer)

    def echoes(self, tokenizer: Tokenizer) -> list[str]:
        """What ``echo`` writes before each prompt's choices: its text as sent, or its
        token ids decoded."""
        batch: list[Any] = [self.prompt] if _is_single(self.prompt) else list(self.prompt)
        return [item if isinstance(item, str) else tokenizer.decode(item) for item in batch]


class ChatMessage(BaseModel):
    """A message as OpenAI clients send it: text, a list of content parts, or nothing
    but tool calls; tool and function results; names."""

    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None

    @model_validator(mode="after")
    def _content_or_tool_calls(self) -> ChatMessage:
        if self.content is None and self.role != "assistant":
            raise ValueError(
                f"content is required in a {self.role} message "
                "(only an assistant message may leave it out, to call tools)"
            )
        return self

    def text(self, index: int) -> str:
        """The message as the chat template renders it: text parts joined by newlines
        (as vLLM joins them), tool calls after the text. Raises :class:`Rejected`
        naming a part this text-only model cannot read."""
        text = self.content if isinstance(self.content, str) else ""
        if isinstance(self.content, list):
            text = "\n".join(_part_text(part, index, k) for k, part in enumerate(self.content))
        if self.tool_calls:
            calls = json.dumps(self.tool_calls, sort_keys=True, separators=(",", ":"))
            text = f"{text}<tool_calls>{calls}" if text else f"<tool_calls>{calls}"
        return text


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=1_000_000)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    #: Rendered by the chat template with ``tools``, as vLLM renders them.
    documents: list[dict[str, str]] | None = None
    reasoning_effort: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _template_fields_as_vllm_reads_them(self) -> ChatCompletionRequest:
        self.template_variables()  # a tool without a name, say: vLLM's 400
        return self

    def template_variables(self) -> dict[str, Any]:
        """What the chat template is given beside the messages, as vLLM gives it."""
        fields = {"tools", "documents", "reasoning_effort", "chat_template_kwargs"}
        return chat_variables(self.model_dump(include=fields))

    @model_validator(mode="after")
    def _tool_choice_as_vllm_checks_it(self) -> ChatCompletionRequest:
        """vLLM's checks, in its words. Without its tool-call flags vLLM answers
        ``"auto"`` with text, as the simulated model does; ``"required"`` and a named
        tool it forces with structured outputs, which the simulated model cannot."""
        choice = self.tool_choice
        if self.tools == []:
            raise ValueError(
                "`tools` must not be an empty array. "
                "Either provide at least one tool or omit the field entirely."
            )
        if choice is None or choice == "none":
            return self
        if not self.tools:
            raise ValueError("When using `tool_choice`, `tools` must be set.")
        if choice not in ("auto", "required") and not isinstance(choice, dict):
            raise ValueError(
                f"Invalid value for `tool_choice`: {choice}! "
                'Only named tools, "none", "auto" or "required" are supported.'
            )
        if isinstance(choice, dict):
            name = (choice.get("function") or {}).get("name")
            if name not in {(t.get("function") or {}).get("name") for t in self.tools}:
                raise ValueError(
                    "The tool specified in `tool_choice` does not match any "
                    "of the specified `tools`"
                )
        if choice != "auto":
            raise ValueError(
                "tool_choice 'required' or a named tool: the simulated model cannot be "
                "made to call a tool (vLLM forces one with structured outputs); "
                "send 'auto' or 'none'"
            )
        return self

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("when using `top_logprobs`, `logprobs` must be set to true")
        return self

    def token_limit(self) -> int:
        return self.max_completion_tokens or self.max_tokens or DEFAULT_CHAT_TOKENS

    def prompt_messages(self) -> list[dict[str, str]]:
        """The conversation as role and text, ready for the chat template."""
        return [{"role": m.role, "content": m.text(i)} for i, m in enumerate(self.messages)]

    def prompt_ids(self, tokenizer: Tokenizer, cache_scope: str | None = None) -> np.ndarray:
        """The conversation through the chat template, with what vLLM gives it beside the
        messages; a template that refuses it (no tools, say) is vLLM's 400."""
        variables = self.template_variables()
        return conversation_ids(tokenizer, self.prompt_messages(), True, cache_scope, variables)


class TokenizeRequest(BaseModel):
    """vLLM's ``POST /tokenize``: a completion's ``prompt`` or a conversation's
    ``messages`` (rendered by the chat template, with the generation prompt unless told)."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = True
    #: What vLLM's /tokenize gives the chat template beside the messages.
    tools: list[dict[str, Any]] | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _one_of_prompt_or_messages(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give either prompt or messages")
        self.template_variables()  # a tool without a name, say: vLLM's 400
        return self

    def template_variables(self) -> dict[str, Any]:
        return tokenize_variables(self.model_dump(include={"tools", "chat_template_kwargs"}))

    def token_ids(self, tokenizer: Tokenizer) -> np.ndarray:
        if self.prompt is not None:
            return tokenizer.encode(self.prompt)
        messages = [
            {"role": m.role, "content": m.text(i)} for i, m in enumerate(self.messages or ())
        ]
        variables = self.template_variables()
        return conversation_ids(tokenizer, messages, self.add_generation_prompt, None, variables)


def conversation_ids(
    tokenizer: Tokenizer,
    messages: list[dict[str, str]],
    add_generation_prompt: bool,
    cache_scope: str | None,
    variables: dict[str, Any],
) -> np.ndarray:
    """The ids of a conversation; raises :class:`Rejected` (400) where the chat template
    refuses it, as vLLM answers a template's error."""
    try:
        return tokenizer.apply_chat_template(
            messages, add_generation_prompt, cache_scope=cache_scope, variables=variables
        )
    except ValueError as error:
        raise Rejected(str(error), 400, "messages") from None


_MESSAGES = TypeAdapter(list[ChatMessage])


def chat_prompt_messages(messages: Any) -> list[dict[str, str]]:
    """``messages`` as they came in a request body, as role and text for the chat
    template (what the gateway routes by); raises ``ValueError`` if it cannot read them."""
    parsed = _MESSAGES.validate_python(messages)
    if not parsed:
        raise ValueError("no messages")
    return [{"role": m.role, "content": m.text(i)} for i, m in enumerate(parsed)]


def prompt_token_ids(prompt: Any, tokenizer: Tokenizer) -> list[np.ndarray]:
    """A completion's ``prompt`` (text, token ids, or a batch of either) as token ids,
    one array per prompt; raises :class:`Rejected` (a ``ValueError``) naming what is
    wrong: an empty prompt, a token id out of range, a shape that is none of these."""
    batch: list[Any] = [prompt] if _is_single(prompt) else prompt
    if not isinstance(batch, list) or not batch:
        raise Rejected("prompt must be text, token ids, or a non-empty list of them", 400, "prompt")
    return [_token_ids(item, tokenizer, index) for index, item in enumerate(batch)]


def _part_text(part: dict[str, Any], message: int, index: int) -> str:
    kind = part.get("type")
    text = part.get("text")
    if kind in TEXT_PARTS and isinstance(text, str):
        return text
    where = f"messages.{message}.content.{index}"
    if kind in TEXT_PARTS:
        raise Rejected(f"{where}.text: a text part needs its text", 400, f"{where}.text")
    raise Rejected(
        f"{where}.type: content part {kind!r} is not supported by this text-only model "
        f"(supported: {', '.join(TEXT_PARTS)})",
        400,
        f"{where}.type",
    )


def _is_single(prompt: object) -> bool:
    """A prompt of text or of token ids, not a batch of them."""
    return isinstance(prompt, str) or (
        isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], int)
    )


def _token_ids(prompt: Any, tokenizer: Tokenizer, index: int) -> np.ndarray:
    where = "prompt" if index == 0 else f"prompt.{index}"
    if not isinstance(prompt, str | list) or not all(
        isinstance(t, int) and not isinstance(t, bool)
        for t in (prompt if isinstance(prompt, list) else ())
    ):
        raise Rejected(f"{where}: a prompt is text or a list of token ids", 400, where)
    if isinstance(prompt, str):
        if not prompt:
            raise Rejected(f"{where}: a prompt must not be empty", 400, where)
        return tokenizer.encode(prompt)
    if not prompt:
        raise Rejected(f"{where}: a prompt must hold at least one token", 400, where)
    if not all(0 <= t <= MAX_TOKEN_ID for t in prompt):
        raise Rejected(f"{where}: token ids must lie in [0, 2**32)", 400, where)
    return np.asarray(prompt, dtype=TOKEN_DTYPE)


class Rejected(ValueError):
    """A request refused with an error status naming the problem (``param``: the
    field): a 4xx for the client's mistakes, a 500 once the engine is dead."""

    def __init__(self, message: str, status: int = 400, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.param = param

    def response(self) -> JSONResponse:
        return JSONResponse(error_body(str(self), self.status, self.param), self.status)


def new_id(prefix: str) -> str:
    """A unique id: 128 random bits in hex, as a uuid4's (without building one: a
    quarter of the time, on every request the gateway routes)."""
    return f"{prefix}-{os.urandom(16).hex()}"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
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
    detail = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    message = f"{where}: {detail}" if where else detail
    return JSONResponse(error_body(message, 400, where or None), status_code=400)


def _is_field(part: object) -> bool:
    """Field names and list indexes, not 'body' or the branch names of a union type."""
    if isinstance(part, int):
        return True
    text = str(part)
    return text != "body" and "[" not in text and text not in {"str", "int", "float", "bool"}
