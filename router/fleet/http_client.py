"""The request path's HTTP/1.1 client: kept-alive connections to each backend, no more.

A general client (aiohttp's) builds a request object, a payload, timers, cookie and
trace hooks for every call; in front of fast replicas that was a third of the
gateway's CPU per request. The request path needs only this: POST a JSON body it
already holds as bytes, then read the answer whole or as its chunks arrive. So a
request is one ``write`` of head and body on an idle connection of the backend's
pool (or a new one), and the answer is parsed by ``httptools`` (the parser uvicorn
uses) as bytes come in. A connection goes back to its pool once its answer is read
to the end and both sides keep it alive.

Failures raise :class:`UpstreamError` (or ``TimeoutError``): the connection could not
be made, broke, or stayed silent longer than ``read_timeout_s``. A kept-alive
connection that the backend had closed before our request reached it is retried
once on a new connection, since the backend never saw it.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from urllib.parse import urlsplit

import httptools


class UpstreamError(Exception):
    """The backend could not be reached, or the connection broke."""


@dataclass(frozen=True)
class Timeouts:
    connect_s: float = 5.0
    #: The longest silence within an answer.
    read_s: float = 120.0
    #: The whole answer.
    total_s: float = 600.0


class Response:
    """One answer: its status and headers, then its body as it arrives."""

    def __init__(self, connection: _Connection, deadline: float) -> None:
        self._connection = connection
        self._deadline = deadline
        self.status = connection.status
        self.headers = connection.headers

    async def chunk(self) -> bytes:
        """The next piece of the body; ``b""`` at its end."""
        return await self._connection.next_chunk(self._deadline)

    async def read(self) -> bytes:
        body = bytearray()
        while piece := await self.chunk():
            body += piece
        return bytes(body)

    async def lines(self) -> AsyncIterator[bytes]:
        """The body's lines (without their ends), for a server-sent event stream."""
        pending = b""
        while piece := await self.chunk():
            *complete, pending = (pending + piece).split(b"\n")
            for line in complete:
                yield line.rstrip(b"\r")
        if pending:
            yield pending

    def release(self) -> None:
        """Done with it: the connection goes back to its pool if the answer was read
        to the end, else it is closed."""
        self._connection.release()


class _Connection(asyncio.Protocol):
    """One TCP connection and the parser of the answer arriving on it."""

    def __init__(self, pool: list[_Connection], read_s: float) -> None:
        self._pool = pool
        self._read_s = read_s
        self._parser = httptools.HttpResponseParser(self)
        self.transport: asyncio.Transport | None = None
        self._reset()

    def _reset(self) -> None:
        self.status = 0
        self.headers: dict[str, str] = {}
        self._chunks: collections.deque[bytes] = collections.deque()
        self._headers_done = False
        self._keep_alive = False
        self._complete = False
        self._waiter: asyncio.Future[None] | None = None
        self._received_any = False
        self._error: Exception | None = None

    # --------------------------------------------------------- asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self._received_any = True
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as error:
            self._fail(UpstreamError(f"invalid HTTP answer: {error}"))

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        if self in self._pool:
            self._pool.remove(self)  # closed while idle
        if not self._complete:
            self._fail(UpstreamError(f"connection closed: {exc!r}" if exc else "server hung up"))

    # --------------------------------------------------------- httptools callbacks

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        self.status = self._parser.get_status_code()
        self._keep_alive = self._parser.should_keep_alive()  # reset once the answer ends
        self._headers_done = True
        self._wake()

    def on_body(self, body: bytes) -> None:
        self._chunks.append(body)
        self._wake()

    def on_message_complete(self) -> None:
        self._complete = True
        self._wake()

    # --------------------------------------------------------- the request path

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def _fail(self, error: Exception) -> None:
        if self._error is None:
            self._error = error
        self._wake()
        if self.transport is not None:
            self.transport.abort()

    async def _wait(self, deadline: float) -> None:
        """Until the parser has news (or the connection broke, or time is up). A plain
        future and a timer: cheaper than ``wait_for``, which makes a task each time."""
        if self._error is not None:
            raise self._error
        timeout = min(self._read_s, deadline - time.monotonic())
        if timeout <= 0:
            self._fail(TimeoutError("the whole answer took too long"))
            raise self._error  # type: ignore[misc]
        loop = asyncio.get_running_loop()
        self._waiter = loop.create_future()
        timer = loop.call_later(timeout, self._fail, TimeoutError(f"silent for {timeout:.0f} s"))
        try:
            await self._waiter
        finally:
            timer.cancel()
            self._waiter = None
        if self._error is not None:
            raise self._error

    async def send(self, request: bytes, deadline: float) -> None:
        """Write a request and wait for the head of its answer."""
        assert self.transport is not None
        self.transport.write(request)
        while not self._headers_done:
            await self._wait(deadline)

    async def next_chunk(self, deadline: float) -> bytes:
        while not self._chunks:
            if self._complete:
                return b""
            await self._wait(deadline)
        return self._chunks.popleft()

    def release(self) -> None:
        reusable = (
            self._complete and not self._chunks and self.transport is not None and self._keep_alive
        )
        if reusable:
            self._reset()
            self._pool.append(self)
        elif self.transport is not None:
            self.transport.abort()

    @property
    def broke_before_answering(self) -> bool:
        return self._error is not None and not self._received_any


@functools.lru_cache(maxsize=4096)
def _target(url: str, headers: bytes) -> tuple[tuple[str, int], bytes]:
    """Where ``url`` is, and the head of a POST to it up to its content length (with
    the client's own ``headers`` lines): the same few backend URLs every request, so
    parsed once each."""
    parts = urlsplit(url)
    path = parts.path + (f"?{parts.query}" if parts.query else "")
    head = (
        (f"POST {path} HTTP/1.1\r\nhost: {parts.netloc}\r\n").encode("latin-1")
        + headers
        + b"content-type: application/json\r\ncontent-length: "
    )
    return (parts.hostname or "127.0.0.1", parts.port or 80), head


class Client:
    """Kept-alive connections to every backend, for POSTing JSON bodies; ``headers``
    go with every request (the fleet's token)."""

    def __init__(
        self, timeouts: Timeouts | None = None, headers: Mapping[str, str] | None = None
    ) -> None:
        self.timeouts = timeouts or Timeouts()
        self._headers = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items()).encode(
            "latin-1"
        )
        self._idle: dict[tuple[str, int], list[_Connection]] = {}

    async def post(self, url: str, body: bytes, headers: bytes = b"") -> Response:
        """POST ``body`` (JSON) to ``url``, with the client's headers and ``headers``
        (lines, each ending ``\r\n``); the answer's head has arrived on return."""
        (host, port), head = _target(url, self._headers + headers)
        request = b"%s%d\r\n\r\n%s" % (head, len(body), body)
        deadline = time.monotonic() + self.timeouts.total_s
        pool = self._idle.setdefault((host, port), [])
        while pool:  # a kept-alive connection; if the backend had dropped it, another
            connection = pool.pop()
            try:
                return await self._send(connection, request, deadline)
            except UpstreamError:
                if not connection.broke_before_answering:
                    raise
        connection = await self._connect(host, port, pool)
        return await self._send(connection, request, deadline)

    @staticmethod
    async def _send(connection: _Connection, request: bytes, deadline: float) -> Response:
        try:
            await connection.send(request, deadline)
        except BaseException:  # failed, timed out, or the caller gave up: close it
            connection.release()
            raise
        return Response(connection, deadline)

    async def _connect(self, host: str, port: int, pool: list[_Connection]) -> _Connection:
        loop = asyncio.get_running_loop()
        try:
            _, connection = await asyncio.wait_for(
                loop.create_connection(lambda: _Connection(pool, self.timeouts.read_s), host, port),
                self.timeouts.connect_s,
            )
        except OSError as error:
            raise UpstreamError(f"cannot connect to {host}:{port}: {error}") from None
        return connection

    def close(self) -> None:
        for pool in self._idle.values():
            for connection in list(pool):
                if connection.transport is not None:
                    connection.transport.close()
        self._idle.clear()
