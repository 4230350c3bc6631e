"""OpenAI answers written from the engine's outputs: streamed as SSE events, or whole.

One answer has one or more choices (``n`` samples of each prompt, for each prompt of
a batch), each an engine request of its own; their outputs are merged in the order
the engine produced them. A choice ends when its engine request does or when its text
reaches a stop string (held back until it cannot be the start of one, as vLLM does;
the engine request is then aborted). Usage counts each prompt once and every choice's
tokens. A streamed chat answer starts with each choice's role, and a streamed answer
ends with the usage (if asked) and ``data: [DONE]``, as OpenAI and vLLM write them.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import xxhash

from replica.api import openai as api
from replica.api.tokenizer import Tokenizer
from replica.engine import EngineDead, RequestOutput


@dataclass(frozen=True)
class AnswerSpec:
    """How to write one answer. ``logprobs``: ``None`` for none, else how many
    alternatives each token lists. ``prompts[i]`` is the prompt choice ``i`` samples."""

    request_id: str
    model: str
    chat: bool
    prompts: Sequence[int]
    stops: Sequence[str] = ()
    logprobs: int | None = None
    include_usage: bool = False
    #: A completion's ``echo``: each prompt's text, written before its choices' text.
    echoes: Sequence[str] = ()
    #: Fields a whole answer carries beside its choices (``kv_transfer_params``).
    extra: Mapping[str, Any] = field(default_factory=dict)

    @property
    def kind(self) -> str:
        return "chat.completion" if self.chat else "text_completion"


@dataclass
class ChoiceState:
    """One choice as it is written: its text so far, held-back text, its figures."""

    index: int
    stops: Sequence[str]
    text: str = ""
    held: str = ""
    finish_reason: str | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    logprobs: list[Any] = field(default_factory=list)

    #: Text written before the first token (an echoed prompt), once.
    echo: str = ""

    def feed(self, new_text: str, output: RequestOutput) -> str:
        """Take one output; return the text to emit now (stop strings withheld)."""
        self.prompt_tokens, self.cached_tokens = output.num_prompt_tokens, output.num_cached_tokens
        self.output_tokens = output.num_output_tokens
        text = self.held + new_text
        cut = min((i for i in (text.find(stop) for stop in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self.held, self.finish_reason = "", "stop"
            return self._emit(text[:cut])
        if output.finished:
            self.held, self.finish_reason = "", output.finish_reason
            return self._emit(text)
        keep = max((len(stop) - 1 for stop in self.stops), default=0)
        self.held = text[len(text) - keep :] if keep else ""
        return self._emit(text[: len(text) - keep] if keep else text)

    def _emit(self, text: str) -> str:
        text, self.echo = self.echo + text, ""
        self.text += text
        return text

    @property
    def done(self) -> bool:
        return self.finish_reason is not None


class Answer:
    """Writes one answer from its choices' engine outputs."""

    def __init__(
        self, spec: AnswerSpec, tokenizer: Tokenizer, on_first_token: Callable[[], None]
    ) -> None:
        self.spec = spec
        self.decode = tokenizer.decode
        self.vocabulary = tokenizer.vocabulary
        self.on_first_token = on_first_token
        self.choices = [
            ChoiceState(i, spec.stops, echo=spec.echoes[p] if spec.echoes else "")
            for i, p in enumerate(spec.prompts)
        ]
        self._created = int(time.time())

    async def stream(self, outputs: ChoiceOutputs) -> AsyncIterator[str]:
        try:
            if self.spec.chat:
                for choice in self.choices:
                    role = {"role": "assistant", "content": ""}
                    yield event(self._chunk(choice.index, role, None))
            first = True
            async for index, output in outputs:
                if first:
                    self.on_first_token()
                    first = False
                choice = self.choices[index]
                text, logprobs = self._advance(choice, output, outputs)
                yield event(self._chunk(index, self._delta(text), choice.finish_reason, logprobs))
                if self._all_done:
                    break
            if self.spec.include_usage:
                yield event(self._usage_chunk())
        except EngineDead as dead:  # an error event, never a silent truncation
            yield event(api.error_body(str(dead), 500))
        finally:
            await outputs.aclose()
        yield "data: [DONE]\n\n"

    async def first_outputs(self, outputs: ChoiceOutputs) -> list[tuple[int, RequestOutput]]:
        """Read until every choice has its first token (every prompt is prefilled)."""
        pulled, seen = [], set()
        async for index, output in outputs:
            pulled.append((index, output))
            seen.add(index)
            if len(seen) == len(self.choices):
                break
        self.on_first_token()
        return pulled

    async def whole(
        self, outputs: ChoiceOutputs, pulled: Sequence[tuple[int, RequestOutput]] = ()
    ) -> AsyncIterator[bytes]:
        """The answer in one JSON body, once every choice has ended (``pulled``: the
        outputs :meth:`first_outputs` read already)."""
        try:
            for index, output in pulled:
                self._advance(self.choices[index], output, outputs)
            if not self._all_done:
                async for index, output in outputs:
                    self._advance(self.choices[index], output, outputs)
                    if self._all_done:
                        break
            body = self._body()
        except EngineDead as dead:  # the headers are gone: the body says what happened
            body = api.error_body(str(dead), 500)
        finally:
            await outputs.aclose()
        yield json.dumps(body).encode()

    @property
    def _all_done(self) -> bool:
        return all(choice.done for choice in self.choices)

    def _advance(
        self, choice: ChoiceState, output: RequestOutput, outputs: ChoiceOutputs
    ) -> tuple[str, Any]:
        start = choice.output_tokens
        text = choice.feed(self.decode(output.new_token_ids), output)
        logprobs = None
        if self.spec.logprobs is not None:
            logprobs = self._logprobs(output.new_token_ids, start, len(choice.text) - len(text))
            choice.logprobs.append(logprobs)
        if choice.done and not output.finished:
            outputs.close(choice.index)  # a stop string ended it: free the engine's work
        return text, logprobs

    # ----------------------------------------------------------------- shapes

    def _delta(self, text: str) -> dict[str, str]:
        return {"content": text}

    def _chunk(
        self, index: int, delta: dict[str, str], finish: str | None, logprobs: Any = None
    ) -> dict[str, Any]:
        if self.spec.chat:
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        else:
            text = delta.get("content", "")
            choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}
        return {
            **self._head(self.spec.kind + (".chunk" if self.spec.chat else "")),
            "choices": [choice],
        }

    def _body(self) -> dict[str, Any]:
        choices = []
        for choice in self.choices:
            logprobs = (
                self._joined_logprobs(choice.logprobs) if self.spec.logprobs is not None else None
            )
            if self.spec.chat:
                message = {"role": "assistant", "content": choice.text}
                entry = {"index": choice.index, "message": message}
            else:
                entry = {"index": choice.index, "text": choice.text}
            choices.append({**entry, "logprobs": logprobs, "finish_reason": choice.finish_reason})
        body = {**self._head(self.spec.kind), "choices": choices, "usage": self.usage()}
        return {**body, **self.spec.extra}

    def _usage_chunk(self) -> dict[str, Any]:
        kind = self.spec.kind + (".chunk" if self.spec.chat else "")
        return {**self._head(kind), "choices": [], "usage": self.usage()}

    def _head(self, kind: str) -> dict[str, Any]:
        return {
            "id": self.spec.request_id,
            "object": kind,
            "created": self._created,
            "model": self.spec.model,
        }

    def usage(self) -> dict[str, Any]:
        """Each prompt counted once (its first choice's figures), every choice's output."""
        first_of_prompt: dict[int, ChoiceState] = {}
        for choice, prompt in zip(self.choices, self.spec.prompts, strict=True):
            first_of_prompt.setdefault(prompt, choice)
        prompt_tokens = sum(c.prompt_tokens for c in first_of_prompt.values())
        cached = sum(c.cached_tokens for c in first_of_prompt.values())
        return api.usage(prompt_tokens, sum(c.output_tokens for c in self.choices), cached)

    # ----------------------------------------------------------------- logprobs

    def _logprobs(self, tokens: list[int], position: int, offset: int) -> Any:
        """Simulated, well-formed logprobs of ``tokens``: each token's own, and the
        alternatives asked for, less likely than it (deterministic)."""
        entries = [self._token_logprob(t, position + i) for i, t in enumerate(tokens)]
        if self.spec.chat:
            return {"content": [self._chat_entry(*entry) for entry in entries], "refusal": None}
        offsets, cursor = [], offset
        for token, _, _ in entries:
            offsets.append(cursor)
            cursor += len(token)
        return {
            "tokens": [token for token, _, _ in entries],
            "token_logprobs": [logprob for _, logprob, _ in entries],
            "top_logprobs": [
                dict([(token, logprob), *alternatives]) for token, logprob, alternatives in entries
            ],
            "text_offset": offsets,
        }

    def _token_logprob(self, token_id: int, position: int) -> tuple[str, float, list]:
        draw = xxhash.xxh3_64_intdigest(f"{token_id}:{position}".encode())
        logprob = -((draw % 2000) / 1000.0)  # in (-2, 0]
        token = self.decode([token_id])
        # Distinct texts, none the token's own: a legacy completion keys its
        # top_logprobs by text, so a repeat would silently shrink the dict.
        seen, alternatives = {token}, list[tuple[str, float]]()
        wanted = min(self.spec.logprobs or 0, len(self.vocabulary) - 1)
        step = 0
        while len(alternatives) < wanted and step < 4 * len(self.vocabulary):
            step += 1
            other = self.decode([self.vocabulary[(draw + 7919 * step) % len(self.vocabulary)]])
            if other not in seen:
                seen.add(other)
                alternatives.append((other, logprob - 0.5 * (len(alternatives) + 1)))
        return token, logprob, alternatives

    @staticmethod
    def _chat_entry(token: str, logprob: float, alternatives: list) -> dict[str, Any]:
        return {
            "token": token,
            "logprob": logprob,
            "bytes": list(token.encode()),
            "top_logprobs": [
                {"token": t, "logprob": lp, "bytes": list(t.encode())} for t, lp in alternatives
            ],
        }

    def _joined_logprobs(self, parts: list[Any]) -> Any:
        if self.spec.chat:
            return {"content": [e for p in parts for e in p["content"]], "refusal": None}
        keys = ("tokens", "token_logprobs", "top_logprobs", "text_offset")
        joined: dict[str, list[Any]] = {key: [] for key in keys}
        for part in parts:
            for key in joined:
                joined[key] += part[key]
        return joined


class ChoiceOutputs:
    """The outputs of an answer's engine requests, merged in the order the engine
    produced them: ``(choice index, output)``. Closing a choice ends its stream, which
    aborts its engine request; :meth:`aclose` ends them all (a client that left)."""

    def __init__(self, streams: Sequence[AsyncIterator[RequestOutput]]) -> None:
        self._streams = list(streams)
        self._queue: asyncio.Queue[tuple[int, RequestOutput | EngineDead | None]] = asyncio.Queue()
        self._tasks: dict[int, asyncio.Task[None]] = {}
        self._iterator = self._merged()

    def __aiter__(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        return self._iterator  # one iterator: a second ``async for`` resumes the first

    async def _merged(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        if len(self._streams) == 1:  # the common case, without tasks
            async for output in self._streams[0]:
                yield 0, output
            return
        loop = asyncio.get_running_loop()
        for index, stream in enumerate(self._streams):
            self._tasks[index] = loop.create_task(self._pump(index, stream))
        remaining = len(self._streams)
        while remaining:
            index, pumped = await self._queue.get()
            if isinstance(pumped, EngineDead):
                raise pumped
            if pumped is None:
                remaining -= 1
            else:
                yield index, pumped

    async def _pump(self, index: int, stream: AsyncIterator[RequestOutput]) -> None:
        try:
            async for output in stream:
                self._queue.put_nowait((index, output))
        except EngineDead as dead:  # handed to the reader, who raises it
            self._queue.put_nowait((index, dead))
        finally:
            self._queue.put_nowait((index, None))

    def close(self, index: int) -> None:
        """Stop one choice early (a stop string ended it): its engine request is aborted."""
        task = self._tasks.get(index)
        if task is not None:
            task.cancel()

    async def aclose(self) -> None:
        for task in self._tasks.values():
            task.cancel()
        await asyncio.gather(*self._tasks.values(), return_exceptions=True)
        await self._iterator.aclose()  # type: ignore[attr-defined]
        for stream in self._streams:
            aclose = getattr(stream, "aclose", None)
            if aclose is not None:
                await aclose()


def event(chunk: dict[str, Any]) -> str:
    return f"data: {json.dumps(chunk)}\n\n"
