"""Serving an ASGI app in the foreground, as every ``prefix-router`` server does."""

from __future__ import annotations

from typing import Any

#: On SIGTERM or Ctrl-C a server stops accepting, lets requests in flight finish (for
#: at most this long), then exits.
GRACEFUL_SHUTDOWN_S = 30


def serve_http(app: Any, host: str, port: int) -> None:
    """Serve an ASGI app in the foreground until interrupted (quiet: no access log)."""
    import uvicorn

    uvicorn.run(
        app,
        host=host,
        port=port,
        log_level="warning",
        access_log=False,
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
    )
