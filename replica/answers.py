"""OpenAI answers written from an engine's outputs: streamed as SSE events, or whole.

A streamed chat answer starts with the assistant's role, then one chunk per step's
tokens, then (if asked) a usage chunk, then ``data: [DONE]``, as OpenAI and vLLM
write them. A whole answer waits for the last token.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from replica.api import openai as api
from replica.engine import RequestOutput


@dataclass(frozen=True)
class Answer:
    """How to write one request's answer; ``on_first_token`` runs when its first token
    is ready (the replica times TTFT with it)."""

    request_id: str
    model: str
    chat: bool
    decode: Callable[[list[int]], str]
    on_first_token: Callable[[], None]

    async def stream(
        self, outputs: AsyncIterator[RequestOutput], include_usage: bool
    ) -> AsyncIterator[str]:
        if self.chat:
            yield event(self._chunk({"role": "assistant", "content": ""}, None))
        last: RequestOutput | None = None
        async for output in outputs:
            if last is None:
                self.on_first_token()
            last = output
            text = self.decode(output.new_token_ids)
            if self.chat:
                yield event(self._chunk({"content": text}, output.finish_reason))
            else:
                chunk = api.completion_chunk(
                    self.request_id, self.model, text, output.finish_reason
                )
                yield event(chunk)
        if include_usage and last is not None:
            kind = "chat.completion.chunk" if self.chat else "text_completion"
            yield event(api.usage_chunk(self.request_id, self.model, kind, usage_of(last)))
        yield "data: [DONE]\n\n"

    async def whole(
        self, first: RequestOutput, outputs: AsyncIterator[RequestOutput]
    ) -> AsyncIterator[bytes]:
        """The answer in one JSON body, from its ``first`` output and the rest."""
        self.on_first_token()
        tokens, last = list(first.new_token_ids), first
        async for output in outputs:
            last = output
            tokens += output.new_token_ids
        build = api.chat_body if self.chat else api.completion_body
        text = self.decode(tokens)
        yield json.dumps(
            build(self.request_id, self.model, text, last.finish_reason, usage_of(last))
        ).encode()

    def _chunk(self, delta: dict[str, str], finish_reason: str | None) -> dict[str, Any]:
        return api.chat_chunk(self.request_id, self.model, delta, finish_reason)


def event(chunk: dict[str, Any]) -> str:
    return f"data: {json.dumps(chunk)}\n\n"


def usage_of(output: RequestOutput) -> dict[str, Any]:
    return api.usage(output.num_prompt_tokens, output.num_output_tokens, output.num_cached_tokens)
