"""The request path: one request from admission to its replica's last byte.

The policy picks a replica among those with room; the request body goes upstream as
the client wrote it (rewritten once, only if a field must change); the answer comes
back without buffering. While no byte has reached the client, a failed replica's
request is retried on another, with jittered exponential backoff. However the
request ends, its load is released exactly once (``Accounting.ended``).
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from functools import partial
from typing import Any

from fastapi.responses import JSONResponse, Response, StreamingResponse

from replica.api import openai as api
from router.admission import Overloaded
from router.backends import Backend
from router.gateway import Gateway
from router.http_client import Client, UpstreamError
from router.http_client import Response as Answer
from router.policies import Policy, ReplicaState, RoutingRequest

#: How a try on a replica can fail: unreachable, broken, or silent too long.
FAILURES = (UpstreamError, TimeoutError)
CACHED_TOKENS = re.compile(rb'"cached_tokens":\s*(\d+)')
COMPLETION_TOKENS = re.compile(rb'"completion_tokens":\s*(\d+)')
#: Upstream answers worth another replica's try (the replica is overloaded or broken).
RETRYABLE_STATUSES = frozenset({500, 502, 503, 504})


#: One try of a request on one replica, chosen by one policy.
Attempt = Callable[[Backend, Policy], Awaitable[Response]]


class UpstreamFailed(Exception):
    """A replica failed before the client got a byte: another replica may serve it."""


class Upstream:
    """Forwards requests for one gateway over its kept-alive ``client``."""

    def __init__(self, gateway: Gateway, client: Client) -> None:
        self.gateway = gateway
        self.client = client

    async def forward(
        self,
        path: str,
        raw: bytes,
        routing: RoutingRequest,
        stream: bool,
        include_usage: bool,
        received: float,
        fields: dict[str, Any] | None = None,
    ) -> Response:
        """Send the request, as the client wrote it (with ``fields`` set), to the
        replica the policy picks, retrying on others while that is safe."""
        gateway = self.gateway
        if not gateway.pool.backends:
            return _error("no backends to route to", 503)
        try:
            states = await gateway.admit(routing)
        except Overloaded as error:
            headers = {"retry-after": str(error.retry_after_s)}
            return JSONResponse(api.error_body(str(error), 429), status_code=429, headers=headers)
        raw = rewritten(raw, stream and not include_usage, fields)
        gateway.metrics.overhead.observe(time.perf_counter() - received)
        send = partial(self._attempt, path, raw, stream, include_usage, routing)
        return await self._with_retries(routing, states, send)

    async def _with_retries(
        self, routing: RoutingRequest, states: list[ReplicaState], send: Attempt
    ) -> Response:
        """``send`` to the policy's choice; after a failure, to its choice among the
        replicas not tried yet, at most ``max_retries`` times."""
        gateway = self.gateway
        tried: set[str] = set()
        failure = UpstreamFailed("every replica is down")
        max_retries = gateway.config.max_retries
        for attempt in range(max_retries + 1):
            candidates = [s for s in states if s.replica_id not in tried]
            if not candidates:
                break
            policy = gateway.policy_of(routing)
            allowed = gateway.within_budget(policy, routing, candidates)
            backend = gateway.pool.by_state(policy.choose(routing, allowed))
            tried.add(backend.state.replica_id)
            gateway.accounting.dispatched(routing, backend.state, policy)
            gateway.admission.fair.dispatched(routing)  # corrected when it ends
            try:
                return await send(backend, policy)
            except UpstreamFailed as error:
                failure = error
            if attempt < max_retries:
                gateway.accounting.retries += 1
                await self._backoff(attempt)
                # circuits may have opened
                states = gateway.available(routing) or gateway.serving(routing)
        return _error(f"no replica could serve the request: {failure}", 502)

    async def _backoff(self, attempt: int) -> None:
        jitter = 0.5 + self.gateway.rng.random()
        await asyncio.sleep(self.gateway.config.retry_backoff_s * 2**attempt * jitter)

    async def _attempt(
        self,
        path: str,
        raw: bytes,
        stream: bool,
        include_usage: bool,
        routing: RoutingRequest,
        backend: Backend,
        policy: Policy,
    ) -> Response:
        """One try on one replica; raises :class:`UpstreamFailed` while retrying is safe."""
        try:
            response = await self.client.post(backend.url + path, raw)
        except FAILURES as error:
            raise self._failed(routing, backend, policy, error) from None
        if response.status in RETRYABLE_STATUSES:
            response.release()
            self._ended(routing, backend, policy, None, failed=True)
            raise UpstreamFailed(f"{backend.url} answered {response.status}")
        if response.status != 200 or not stream:
            return await self._whole(response, routing, backend, policy)
        lines = _lines(response)
        try:  # the first event, before the client sees anything: a failure is retryable
            first = await _first_line(lines)
        except FAILURES as error:
            response.release()
            raise self._failed(routing, backend, policy, error) from None
        return StreamingResponse(
            self._relay(response, lines, first, routing, backend, policy, include_usage),
            media_type="text/event-stream",
            headers=decision_headers(routing, backend),
        )

    def _failed(
        self, routing: RoutingRequest, backend: Backend, policy: Policy, error: BaseException
    ) -> UpstreamFailed:
        """The replica did not answer: release the load, stop routing to it."""
        self._ended(routing, backend, policy, None, failed=True)
        self.gateway.pool.open_circuit(backend)
        return UpstreamFailed(f"{backend.url} failed: {error!r}")

    def _ended(
        self,
        routing: RoutingRequest,
        backend: Backend,
        policy: Policy,
        cached: int | None,
        failed: bool,
        generated: int = 0,
    ) -> None:
        self.gateway.accounting.ended(routing, backend.state, policy, cached, failed)
        self.gateway.admission.fair.ended(routing, cached, generated, failed)
        self.gateway.admission.slot_freed()

    async def _whole(
        self,
        response: Answer,
        routing: RoutingRequest,
        backend: Backend,
        policy: Policy,
    ) -> Response:
        """A whole answer. Our replicas send its headers once the first token exists
        (other servers, at the end): from then on its prefill no longer loads the replica."""
        if response.status == 200:
            self.gateway.accounting.first_token(routing, backend.state, policy)
        try:
            content = await response.read()
        except FAILURES as error:
            raise self._failed(routing, backend, policy, error) from None
        finally:
            response.release()
        cached, generated = None, 0
        if response.status == 200:
            found = CACHED_TOKENS.search(content)  # cheaper than decoding the whole answer
            cached = int(found.group(1)) if found else None
            found = COMPLETION_TOKENS.search(content)
            generated = int(found.group(1)) if found else 0
        failed = response.status >= 500
        self._ended(routing, backend, policy, cached, failed, generated)
        media = response.headers.get("content-type", "application/json")
        headers = decision_headers(routing, backend)
        return Response(content, status_code=response.status, media_type=media, headers=headers)

    async def _relay(
        self,
        response: Answer,
        lines: AsyncIterator[str],
        first: str,
        routing: RoutingRequest,
        backend: Backend,
        policy: Policy,
        client_wants_usage: bool,
    ) -> AsyncIterator[bytes]:
        """Pass the stream through, releasing the prefill at the first generated token
        (not at a chat's role announcement, which comes before any); if the replica dies
        mid-stream, end it with an error event (the client has tokens already: no
        silent truncation, no retry)."""
        cached: int | None = None
        generated = 0
        failed = True
        try:
            line: str | None = first
            while line is not None:
                if routing.prefilling and _carries_token(line):
                    self.gateway.accounting.first_token(routing, backend.state, policy)
                if line.startswith("data: {") and '"usage"' in line:
                    chunk = json.loads(line[6:])
                    if chunk.get("usage") and not chunk.get("choices"):
                        cached = _cached_tokens(chunk["usage"])
                        generated = int(chunk["usage"].get("completion_tokens") or 0)
                        if not client_wants_usage:
                            line = await anext(lines, None)
                            continue  # the gateway asked for it, the client did not
                yield (line + "\n\n").encode()
                line = await anext(lines, None)
            failed = False
        except FAILURES as error:
            self.gateway.pool.open_circuit(backend)
            message = f"upstream {backend.url} failed mid-stream: {error!r}"
            yield f"data: {json.dumps(api.error_body(message, 502))}\n\n".encode()
            yield b"data: [DONE]\n\n"
        finally:
            response.release()
            self._ended(routing, backend, policy, cached, failed, generated)


def decision_headers(routing: RoutingRequest, backend: Backend) -> dict[str, str]:
    """What the router decided, for clients and tests to see: the replica, and the
    cached tokens it expected there (a cache-aware policy's prediction)."""
    headers = {"x-prefix-router-replica": backend.state.replica_id}
    if routing.predicted_cached_tokens is not None:
        headers["x-prefix-router-predicted-cached-tokens"] = str(routing.predicted_cached_tokens)
    return headers


def rewritten(raw: bytes, ask_for_usage: bool, fields: dict[str, Any] | None) -> bytes:
    """The body with ``fields`` set, and a streamed answer's usage asked for (it tells
    the gateway the cached tokens); one rewrite, only when something must change.

    The fields are appended to the object, not merged into a parsed copy: of a JSON
    object's duplicate keys the last wins (Python's ``json``, with which FastAPI, vLLM
    and the replica read bodies), and a 100k-token conversation's 400 KB are copied
    once instead of parsed and printed again (0.05 ms against 2.8).
    """
    fields = dict(fields or {})
    if ask_for_usage:
        fields["stream_options"] = {"include_usage": True}
    if not fields:
        return raw
    head = raw.rstrip()[:-1].rstrip()  # an object (read_envelope checked): less its "}"
    separator = b"" if head.endswith(b"{") else b","
    return head + separator + json.dumps(fields)[1:-1].encode() + b"}"


def _error(message: str, status: int) -> JSONResponse:
    return JSONResponse(api.error_body(message, status), status_code=status)


async def _lines(response: Answer) -> AsyncIterator[str]:
    """The non-empty lines of an SSE stream."""
    async for raw in response.lines():
        if raw:
            yield raw.decode()


async def _first_line(lines: AsyncIterator[str]) -> str:
    line = await anext(lines, None)
    if line is None:
        raise UpstreamError("the stream ended before its first event")
    return line


def _carries_token(line: str) -> bool:
    """Whether an SSE line carries a generated token: text, or the end of a choice."""
    if not line.startswith("data: {"):
        return False
    choices = json.loads(line[6:]).get("choices") or ()
    return any(
        c.get("text") or (c.get("delta") or {}).get("content") or c.get("finish_reason")
        for c in choices
    )


def _cached_tokens(usage: dict[str, Any] | None) -> int | None:
    if not usage:
        return None
    details = usage.get("prompt_tokens_details") or {}
    value = details.get("cached_tokens")
    return int(value) if value is not None else None
