"""Serving an ASGI app: in the foreground, as every ``prefix-router`` server does, in
several worker processes sharing one port, or as a task of a running event loop
(inside a Ray actor)."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import gc
import multiprocessing
import signal
import socket
from collections.abc import Callable
from multiprocessing.connection import wait
from types import FrameType
from typing import Any

import uvicorn

#: On SIGTERM or Ctrl-C a server stops accepting, lets requests in flight finish (for
#: at most this long), then exits.
GRACEFUL_SHUTDOWN_S = 30
#: How often an idle server looks at the clock (uvicorn's own: every 0.1 s).
TICK_S = 1.0
#: How long an idle kept-alive connection stays open. uvicorn's 5 s races with clients
#: that pause about that long between requests (a chat user thinking): the server closes
#: as the client sends, and the client sees a reset (a Locust "HTTP 0"). Load balancers
#: keep connections 60 s (AWS's, nginx's 75 s): longer than any client pause here.
KEEP_ALIVE_S = 75


class Server(uvicorn.Server):
    """uvicorn's server, asleep while there is nothing to do.

    uvicorn wakes every 0.1 s to see whether it should stop: for a fleet of idle
    replicas on one machine that was most of their CPU (24 of them: 3% of a core).
    This one ticks once a second, and a signal or :meth:`stop` wakes it at once.
    """

    async def main_loop(self) -> None:
        self._loop, self._wake = asyncio.get_running_loop(), asyncio.Event()
        counter = 0
        should_exit = await self.on_tick(counter)
        while not should_exit:
            counter += 10  # ``on_tick`` does its once-a-second work on multiples of 10
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), TICK_S)
            should_exit = await self.on_tick(counter)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        super().handle_exit(sig, frame)
        self._wake_up()

    def stop(self) -> None:
        """Stop serving (from any thread): finish the requests in flight, then return."""
        self.should_exit = True
        self._wake_up()

    def _wake_up(self) -> None:
        loop = getattr(self, "_loop", None)
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self._wake.set)


#: Connections the kernel holds for a server that has not accepted them yet (uvicorn's).
BACKLOG = 2048


class PortBusyError(ValueError):
    """The port asked for is taken: a user's error, said in one line."""


def listening_socket(host: str, port: int, reuse_port: bool = False) -> socket.socket:
    """A TCP socket bound to ``host:port`` and listening. With ``reuse_port``, several
    processes can bind the same port and the kernel spreads new connections over them
    (SO_REUSEPORT): that is how several gateways on one machine share one port.

    It listens at once, before its server starts: a client that connects in between
    (a user pasting `curl` as soon as `serve` prints its address) waits in the backlog
    instead of being refused."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((host, port))
    except OSError as error:
        sock.close()
        if error.errno == errno.EADDRINUSE:
            raise PortBusyError(
                f"port {port} on {host} is in use: stop what listens there or give another --port"
            ) from None
        raise
    sock.listen(BACKLOG)
    sock.set_inheritable(True)
    return sock


def uvicorn_config(app: Any, **options: Any) -> Any:
    """Our servers' uvicorn settings: quiet (no access log), graceful on shutdown, idle
    connections kept long enough, and no per-request work nobody reads (proxy headers,
    Server and Date headers); the app's own HTTP protocol where it has one (the
    gateway's: router/http/hot_path.py)."""
    return uvicorn.Config(
        app,
        http=getattr(app, "http_protocol", "auto"),
        log_level="warning",
        access_log=False,
        timeout_keep_alive=KEEP_ALIVE_S,
        proxy_headers=False,
        server_header=False,
        date_header=False,
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
        **options,
    )


#: Allocations between two collections of the youngest generation (CPython's: 700).
YOUNG_COLLECTION_ALLOCATIONS = 20_000


def collect_garbage_rarely() -> None:
    """Fewer garbage collections on the request path, as high-throughput Python servers
    tune theirs: what start-up made lives as long as the process, so it is moved out of
    the collector's sight (``gc.freeze``), and the youngest generation is collected
    every 20,000 allocations instead of 700, since a request's objects die with it and
    seldom in cycles. Measured in front of 4 fast replicas (64 connections, 5 rounds
    interleaved): 256 against 265 us of the gateway's CPU a request. For a gateway's
    process (``gateway``, and ``serve``'s own), just before it serves."""
    gc.freeze()
    gc.set_threshold(YOUNG_COLLECTION_ALLOCATIONS, *gc.get_threshold()[1:])


def serve_http(
    app: Any, host: str, port: int, reuse_port: bool = False, sock: socket.socket | None = None
) -> None:
    """Serve an ASGI app in the foreground until interrupted (on ``sock`` if it is bound
    already, so the port was held while other things started)."""
    sock = sock or listening_socket(host, port, reuse_port)
    with contextlib.suppress(KeyboardInterrupt):  # uvicorn re-raises the signal once stopped
        Server(uvicorn_config(app, host=host, port=port)).run(sockets=[sock])


def serve_workers(worker: Callable[..., None], args: tuple[Any, ...], workers: int) -> int:
    """Run ``worker(*args)`` in ``workers`` processes, each serving on its own socket of
    one port (SO_REUSEPORT: the kernel spreads new connections over them), until they
    end; Ctrl-C or SIGTERM here stops them all, gracefully. A worker that fails stops
    the others. Its status: 0, or the first failure's. Processes are spawned, not
    forked: each starts clean (no event loop, thread or socket of this one)."""
    context = multiprocessing.get_context("spawn")
    processes = [context.Process(target=worker, args=args) for _ in range(workers)]
    for process in processes:
        process.start()

    stopping, status = False, 0

    def stop(*_: Any) -> None:
        nonlocal stopping
        stopping = True
        for process in processes:
            if process.is_alive():
                process.terminate()  # SIGTERM: uvicorn finishes what is in flight

    previous = {signum: signal.signal(signum, stop) for signum in (signal.SIGINT, signal.SIGTERM)}
    try:
        running = list(processes)
        while running:
            for ended in wait([p.sentinel for p in running]):
                process = next(p for p in running if p.sentinel == ended)
                process.join()
                running.remove(process)
                code = process.exitcode or 0
                # uvicorn ends on the SIGTERM it was sent by raising it again: asked to
                failed = code != 0 and not (stopping and code == -signal.SIGTERM)
                if failed and not status:
                    status = code if code > 0 else 1
                    stop()
        return status
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


async def serve_in_loop(
    app: Any, host: str, port: int, sock: socket.socket | None = None, **options: Any
) -> tuple[Server, asyncio.Task[None]]:
    """Serve an ASGI app as a task of the running event loop (a Ray actor's): return
    once it listens, or raise what stopped it before. Stop it with ``server.stop()``,
    then await the task. ``options``: uvicorn's, over ours."""
    server = Server(uvicorn_config(app, host=host, port=port, **options))
    sockets = None if sock is None else [sock]
    task = asyncio.get_running_loop().create_task(server.serve(sockets=sockets))
    while not server.started:
        if task.done():
            task.result()  # raises what stopped the server
        await asyncio.sleep(0.01)
    return server, task
