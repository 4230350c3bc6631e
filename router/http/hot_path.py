"""The completion endpoints served from uvicorn's HTTP protocol itself, without ASGI.

Through ASGI, every completion costs uvicorn a scope, a request-response cycle, an
event and a task, starlette a request whose headers are searched again at each look
and a body read message by message, and the answer two socket writes (its head, then
its body). In front of fast replicas that was a fifth of the gateway's CPU per
request (``python -m benchmarks.bench_gateway --profile``). Here uvicorn's protocol
(httptools) parses the request as before; a POST to a completion endpoint is then
answered by the app's :meth:`GatewayApp.respond <router.http.app.GatewayApp.respond>`
with the headers and body the parser collected, and its answer written in one write
(a stream: its head, then one write a chunk). Every other request, and one that
arrives behind another on its connection (pipelined), goes through ASGI as before.

What uvicorn's cycle does for a request, this does too: keep-alive (and its timer),
``connection: close`` for HTTP/1.0 or when asked, graceful shutdown (it waits for the
answer, then closes), a client that goes away (the answer's task is cancelled, and a
stream's relay settles its request), a body over the gateway's limit (413), an
exception (500, logged).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Mapping
from typing import Any, Protocol

from starlette.responses import JSONResponse, Response, StreamingResponse
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from replica.api import openai as api
from router.path.envelope import Inbound, too_large

log = logging.getLogger(__name__)

#: The completion endpoints, and whether each is a chat's.
HOT_PATHS: dict[str, bool] = {"/v1/completions": False, "/v1/chat/completions": True}
_HOT_URLS = {path.encode(): chat for path, chat in HOT_PATHS.items()}


class Responder(Protocol):
    """The app's side: ``GatewayApp`` (router/http/app.py)."""

    def respond(self, path: str, chat: bool, inbound: Inbound) -> Awaitable[Response]: ...

    @property
    def max_request_bytes(self) -> int: ...


class _NoEvent:
    """uvicorn sets its cycle's event when the connection is lost: nothing waits here."""

    def set(self) -> None:
        pass


class HotRequest:
    """A completion request being read, then answered: it stands in uvicorn's
    ``cycle`` meanwhile, so that a request pipelined behind it waits its turn and a
    graceful shutdown lets it finish (``keep_alive`` turned off)."""

    message_event = _NoEvent()

    def __init__(self, path: str, chat: bool, headers: Mapping[str, str], keep_alive: bool) -> None:
        self.path, self.chat, self.headers, self.keep_alive = path, chat, headers, keep_alive
        self.received = bytearray()
        self.over_limit = False
        self.response_complete = False
        self.disconnected = False
        self.limit = 0

    async def body(self, limit: int) -> bytes:
        if self.over_limit or len(self.received) > limit:
            raise too_large(limit)
        return bytes(self.received)


class HotPathProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol, answering completion requests itself."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        app: Any = self.config.app
        self._app: Responder | None = app if hasattr(app, "respond") else None
        self._task: asyncio.Task[None] | None = None
        self._limit: int | None = None  # the app's body limit, read at the first request

    def on_headers_complete(self) -> None:
        hot = self._hot_request()
        if hot is None:
            super().on_headers_complete()
        else:
            self.cycle = hot  # type: ignore[assignment]

    def _hot_request(self) -> HotRequest | None:
        """The request, if it is a completion this protocol answers now."""
        if self._app is None or self.parser.get_method() != b"POST":
            return None
        chat = _HOT_URLS.get(self.url)  # exactly the path: no query, no escapes
        busy = self.cycle is not None and not self.cycle.response_complete
        if chat is None or busy or self.expect_100_continue or self.root_path:
            return None
        if self.limit_concurrency is not None or self.parser.should_upgrade():
            return None
        headers = Headers()
        for name, value in self.headers:
            headers.setdefault(name.decode("latin-1"), value.decode("latin-1"))
        keep_alive = self.parser.get_http_version() != "1.0" and self.parser.should_keep_alive()
        hot = HotRequest(self.url.decode(), chat, headers, keep_alive)
        if self._limit is None:
            self._limit = self._app.max_request_bytes
        hot.limit = self._limit
        return hot

    def on_body(self, body: bytes) -> None:
        hot = self.cycle
        if not isinstance(hot, HotRequest):
            super().on_body(body)
        elif not hot.over_limit:
            hot.received += body
            if len(hot.received) > hot.limit:  # kept no further: 413 once it is all in
                hot.over_limit, hot.received = True, bytearray()

    def on_message_complete(self) -> None:
        hot = self.cycle
        if not isinstance(hot, HotRequest):
            super().on_message_complete()
            return
        task = self.loop.create_task(self._answer(hot))
        task.add_done_callback(self.tasks.discard)
        self.tasks.add(task)
        self._task = task

    async def _answer(self, hot: HotRequest) -> None:
        assert self._app is not None
        wrote = False
        try:
            response = await self._app.respond(hot.path, hot.chat, hot)
            wrote = True
            await self._write(response, hot)
        except Exception:  # as uvicorn: log it, answer 500 if nothing went out
            log.exception("the gateway failed a request to %s", hot.path)
            if not wrote and not self.transport.is_closing():
                message = api.error_body("the gateway failed the request", 500)
                hot.keep_alive = False
                await self._write(JSONResponse(message, status_code=500), hot)
            else:
                self.transport.close()
        finally:
            self._task = None
        hot.response_complete = True
        if self.transport.is_closing():
            return
        if not hot.keep_alive:
            self.transport.close()
        else:
            self.on_response_complete()  # keep-alive timer, or the next pipelined request

    async def _write(self, response: Response, hot: HotRequest) -> None:
        head: list[bytes | memoryview] = [STATUS_LINE[response.status_code]]
        for name, value in response.raw_headers:
            head += (name, b": ", value, b"\r\n")
        if not hot.keep_alive:
            head.append(b"connection: close\r\n")
        if not isinstance(response, StreamingResponse):
            head += (b"\r\n", response.body)
            self.transport.write(b"".join(head))
        else:
            head.append(b"transfer-encoding: chunked\r\n\r\n")
            self.transport.write(b"".join(head))
            await self._stream(response)
        if response.background is not None:
            await response.background()

    async def _stream(self, response: StreamingResponse) -> None:
        chunks = response.body_iterator
        try:
            async for chunk in chunks:
                data = chunk if isinstance(chunk, bytes) else str(chunk).encode()
                if data:
                    self.transport.write(b"%x\r\n%b\r\n" % (len(data), data))
                if self.flow.write_paused:
                    await self.flow.drain()
            self.transport.write(b"0\r\n\r\n")
        finally:  # the relay settles its request, even when the client went away
            close = getattr(chunks, "aclose", None)
            if close is not None:
                await close()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._task is not None:
            self._task.cancel()  # the client is gone: stop relaying (and settle)
        super().connection_lost(exc)

    def shutdown(self) -> None:
        hot = self.cycle
        if isinstance(hot, HotRequest) and not hot.response_complete:
            hot.keep_alive = False  # finish the answer, then close
        else:
            super().shutdown()


class Headers(dict[str, str]):
    """A request's headers, named in lower case (the first of a name's lines), looked
    up in any case as starlette's are."""

    def get(self, name: str, default: Any = None) -> Any:
        return dict.get(self, name.lower(), default)
