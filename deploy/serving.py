"""Serving an ASGI app in the foreground, as every ``prefix-router`` server does."""

from __future__ import annotations

import contextlib
import socket
from typing import Any

#: On SIGTERM or Ctrl-C a server stops accepting, lets requests in flight finish (for
#: at most this long), then exits.
GRACEFUL_SHUTDOWN_S = 30


def listening_socket(host: str, port: int, reuse_port: bool = False) -> socket.socket:
    """A TCP socket bound to ``host:port``. With ``reuse_port``, several processes can
    bind the same port and the kernel spreads new connections over them (SO_REUSEPORT):
    that is how several gateways on one machine share one port."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


def uvicorn_config(app: Any, **options: Any) -> Any:
    """Our servers' uvicorn settings: quiet (no access log), graceful on shutdown, and
    no per-request work nobody reads (proxy headers, Server and Date headers)."""
    import uvicorn

    return uvicorn.Config(
        app,
        log_level="warning",
        access_log=False,
        proxy_headers=False,
        server_header=False,
        date_header=False,
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
        **options,
    )


def serve_http(app: Any, host: str, port: int, reuse_port: bool = False) -> None:
    """Serve an ASGI app in the foreground until interrupted."""
    import uvicorn

    sock = listening_socket(host, port, reuse_port)
    with contextlib.suppress(KeyboardInterrupt):  # uvicorn re-raises the signal once stopped
        uvicorn.Server(uvicorn_config(app, host=host, port=port)).run(sockets=[sock])
