"""Stage 5 of the request path: dispatch a placed request to its replica, and relay
the answer.

The body goes upstream as the client wrote it (rewritten once, only if a field must
change: ``Ticket.body``); the answer comes back without buffering. A try that fails
before the client has a byte raises :class:`UpstreamFailed`, and the gateway places
the request again on another replica (``router/gateway.py``); once bytes have gone
out, a failure ends the stream with an error event. However the try ends, it is
settled exactly once (``router/path/settle.py``).
"""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator
from typing import Any

from fastapi.responses import JSONResponse, Response, StreamingResponse

from replica.api import kv_params
from replica.api import openai as api
from router.core import RoutingRequest
from router.fleet.backends import Backend, BackendPool
from router.fleet.data_parallel import rank_header
from router.fleet.http_client import Client, UpstreamError
from router.fleet.http_client import Response as Answer
from router.path.place import Placement
from router.path.resolve import Ticket
from router.path.settle import Settlement

#: How a try on a replica can fail: unreachable, broken, or silent too long.
FAILURES = (UpstreamError, TimeoutError)
CACHED_TOKENS = re.compile(rb'"cached_tokens":\s*(\d+)')
COMPLETION_TOKENS = re.compile(rb'"completion_tokens":\s*(\d+)')
#: Upstream answers worth another replica's try (the replica is overloaded or broken).
RETRYABLE_STATUSES = frozenset({500, 502, 503, 504})


class UpstreamFailed(Exception):
    """A replica failed before the client got a byte: another replica may serve it."""


class Dispatcher:
    """Sends one gateway's requests over its kept-alive ``client``."""

    def __init__(self, client: Client, pool: BackendPool, settlement: Settlement) -> None:
        self.client, self.pool, self.settlement = client, pool, settlement

    async def send(self, ticket: Ticket, placement: Placement) -> Response:
        """One try on the placed replica; raises :class:`UpstreamFailed` while retrying
        is safe."""
        backend, request = placement.backend, ticket.request
        body = ticket.body
        if placement.prefill is not None:
            prefilled = await self._prefilled(ticket, placement)
            if isinstance(prefilled, Response):
                return prefilled  # the prefill replica refused it: so would the decode one
            body = prefilled
        elif placement.pull_from is not None and request.kv is not None:
            params = kv_params.pull_params(placement.pull_from.url, request.kv.pull_tokens)
            body = with_fields(body, kv_transfer_params=params)
        try:
            response = await self.client.post(
                backend.url + ticket.envelope.path, body, rank_header(backend.dp_rank)
            )
        except FAILURES as error:
            raise self._failed(request, placement, error) from None
        if response.status in RETRYABLE_STATUSES:
            response.release()
            self.settlement.ended(request, placement, None, failed=True)
            raise UpstreamFailed(f"{backend.url} answered {response.status}")
        if response.status != 200 or not ticket.envelope.stream:
            return await self._whole(response, request, placement)
        lines = _lines(response)
        try:  # the first event, before the client sees anything: a failure is retryable
            first = await _first_line(lines)
        except FAILURES as error:
            response.release()
            raise self._failed(request, placement, error) from None
        include_usage = ticket.envelope.include_usage
        return StreamingResponse(
            self._relay(response, lines, first, request, placement, include_usage),
            media_type="text/event-stream",
            headers=decision_headers(request, backend),
        )

    async def _prefilled(self, ticket: Ticket, placement: Placement) -> bytes | Response:
        """A disaggregated request's prefill leg, as vLLM's P/D proxies send it (one
        token, a whole answer, ``do_remote_decode``); then the decode replica's load is
        recorded and its body returned, with the prefill's ``kv_transfer_params``.
        Raises :class:`UpstreamFailed` if the prefill replica failed; returns its answer
        if it refused the request (a 4xx: the client's to fix). Either way the try is
        settled."""
        request, prefill = ticket.request, placement.prefill
        assert prefill is not None
        cached, params, failure, refused = None, None, None, None
        try:
            response = await self.client.post(
                prefill.url + ticket.envelope.path,
                prefill_body(ticket.body),
                rank_header(prefill.dp_rank),
            )
            try:
                content = await response.read()
            finally:
                response.release()
            if response.status == 200:
                answer = json.loads(content)
                params, cached = (
                    answer.get("kv_transfer_params"),
                    _cached_tokens(answer.get("usage")),
                )
            elif response.status in RETRYABLE_STATUSES:
                failure = f"{prefill.url} answered {response.status} to the prefill"
            else:
                media = response.headers.get("content-type", "application/json")
                headers = decision_headers(request, placement.backend)
                refused = Response(content, response.status, media_type=media, headers=headers)
        except FAILURES as error:
            self.pool.open_circuit(prefill)
            failure = f"{prefill.url} failed the prefill: {error!r}"
        policy, accounting = placement.policy, self.settlement.accounting
        accounting.prefill_ended(request, prefill.state, policy, cached, failure is not None)
        block = accounting.block_tokens
        request.predicted_cached_tokens = (request.num_prompt_tokens - 1) // block * block
        accounting.dispatched(request, placement.backend.state, policy)  # the decode leg
        if failure is not None or refused is not None:
            self.settlement.ended(request, placement, None, failed=failure is not None)
        if failure is not None:
            raise UpstreamFailed(failure)
        if refused is not None:
            return refused
        return with_fields(ticket.body, kv_transfer_params=params)

    def _failed(
        self, request: RoutingRequest, placement: Placement, error: BaseException
    ) -> UpstreamFailed:
        """The replica did not answer: settle the try, stop routing to it."""
        self.settlement.ended(request, placement, None, failed=True)
        self.pool.open_circuit(placement.backend)
        return UpstreamFailed(f"{placement.backend.url} failed: {error!r}")

    async def _whole(
        self, response: Answer, request: RoutingRequest, placement: Placement
    ) -> Response:
        """A whole answer. Our replicas send its headers once the first token exists
        (other servers, at the end): from then on its prefill no longer loads the replica."""
        if response.status == 200:
            self.settlement.first_token(request, placement)
        try:
            content = await response.read()
        except FAILURES as error:
            raise self._failed(request, placement, error) from None
        finally:
            response.release()
        cached, generated = None, 0
        if response.status == 200:
            found = CACHED_TOKENS.search(content)  # cheaper than decoding the whole answer
            cached = int(found.group(1)) if found else None
            found = COMPLETION_TOKENS.search(content)
            generated = int(found.group(1)) if found else 0
        failed = response.status >= 500
        self.settlement.ended(request, placement, cached, failed, generated)
        media = response.headers.get("content-type", "application/json")
        headers = decision_headers(request, placement.backend)
        return Response(content, status_code=response.status, media_type=media, headers=headers)

    async def _relay(
        self,
        response: Answer,
        lines: AsyncIterator[str],
        first: str,
        request: RoutingRequest,
        placement: Placement,
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
                if request.prefilling and _carries_token(line):
                    self.settlement.first_token(request, placement)
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
            self.pool.open_circuit(placement.backend)
            message = f"upstream {placement.backend.url} failed mid-stream: {error!r}"
            yield f"data: {json.dumps(api.error_body(message, 502))}\n\n".encode()
            yield b"data: [DONE]\n\n"
        finally:
            response.release()
            self.settlement.ended(request, placement, cached, failed, generated)


def with_fields(body: bytes, **fields: Any) -> bytes:
    """A JSON body with ``fields`` set (a P/D leg's: rewritten only on that path)."""
    return json.dumps({**json.loads(body), **fields}).encode()


def prefill_body(body: bytes) -> bytes:
    """The prefill leg of a disaggregated request, as vLLM's P/D proxies write it: one
    token, a whole answer, the KV held for a remote decode."""
    data = json.loads(body)
    data.update(max_tokens=1, stream=False, kv_transfer_params={"do_remote_decode": True})
    if "max_completion_tokens" in data:
        data["max_completion_tokens"] = 1
    for field in ("stream_options", "min_tokens"):
        data.pop(field, None)
    return json.dumps(data).encode()


def decision_headers(routing: RoutingRequest, backend: Backend) -> dict[str, str]:
    """What the router decided, for clients and tests to see: the replica, the cached
    tokens it expected there (a cache-aware policy's prediction), and where the KV came
    from (a prefill replica, or a peer it was pulled from)."""
    headers = {"x-prefix-router-replica": backend.state.replica_id}
    plan = routing.kv
    if plan is not None and plan.prefill is not None:
        headers["x-prefix-router-prefill"] = plan.prefill.replica_id
    elif plan is not None and plan.pull_from is not None:
        headers["x-prefix-router-pulled-from"] = plan.pull_from.replica_id
    if routing.predicted_cached_tokens is not None:
        headers["x-prefix-router-predicted-cached-tokens"] = str(routing.predicted_cached_tokens)
    return headers


def error_response(message: str, status: int, headers: dict[str, str] | None = None) -> Response:
    """An error answered by the gateway itself, in the OpenAI shape."""
    return JSONResponse(api.error_body(message, status), status_code=status, headers=headers)


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
