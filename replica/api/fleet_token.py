"""The fleet's credential: replicas answer only requests that carry the fleet's token.

A replica's endpoints are the fleet's, not the public's: its completions skip the
gateway's keys, quotas and fair queue, ``/kv_events`` shows every tenant's token ids
and salts, ``/reset`` and ``/v1/load_lora_adapter`` change it. So every replica (ours,
and vLLM's through vLLM's ``--api-key`` and this guard) answers only requests that
carry ``Authorization: Bearer <token>``, except ``/health``, which load balancers and
Ray probe without credentials. A request without it gets 401 and one log line.

``serve`` and ``up`` make a token and give it to every replica and gateway they start;
pieces started alone read it from ``--fleet-token-file`` or
``$PREFIX_ROUTER_FLEET_TOKEN``. No token configured: the replica answers anyone, as a
development server on loopback does.

The guard is plain ASGI (no framework's middleware machinery), so that vLLM's server
takes it as it is (``--middleware replica.api.fleet_token.FleetTokenGuard``); there it
reads the token from the environment, the only thing vLLM gives a middleware.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import time
from collections.abc import Awaitable, Callable, Mapping, MutableMapping
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

ENV_FLEET_TOKEN = "PREFIX_ROUTER_FLEET_TOKEN"
#: Paths answered without the token: health probes carry no credentials.
OPEN_PATHS = frozenset({"/health"})
#: Refusals are logged one line each, at most one line a second (a scanner's flood
#: would otherwise fill the log); those left out are counted in the next line.
LOG_EVERY_S = 1.0

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


def fleet_token(path: str = "", env: Mapping[str, str] | None = None) -> str:
    """The fleet's token: the file's content at ``path`` (stripped), else
    ``$PREFIX_ROUTER_FLEET_TOKEN``; empty if neither says."""
    if path:
        token = Path(path).read_text().strip()
        if not token:
            raise ValueError(f"the fleet token file {path} is empty")
        return token
    return (os.environ if env is None else env).get(ENV_FLEET_TOKEN, "").strip()


def bearer(token: str) -> dict[str, str]:
    """The header that carries ``token`` (none without one)."""
    return {"authorization": f"Bearer {token}"} if token else {}


class FleetTokenGuard:
    """ASGI middleware: 401 for a request to any path but ``/health`` that does not
    carry the fleet's token (``token``: else ``$PREFIX_ROUTER_FLEET_TOKEN``; none: every
    request passes)."""

    def __init__(
        self,
        app: ASGIApp,
        token: str | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.app = app
        self.clock = clock
        token = fleet_token() if token is None else token
        self._digest = _digest(token) if token else None
        self.refused = 0
        self._logged_at = float("-inf")
        self._unlogged = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        guarded = scope["type"] in ("http", "websocket") and scope["path"] not in OPEN_PATHS
        if self._digest is None or not guarded or self._carries_token(scope):
            await self.app(scope, receive, send)
            return
        self._log(scope)
        if scope["type"] == "websocket":  # refused before its handshake: HTTP 403
            await send({"type": "websocket.close", "code": 1008})
        else:
            await _unauthorized(send)

    def _carries_token(self, scope: Scope) -> bool:
        for name, value in scope["headers"]:
            if name == b"authorization":
                scheme, _, token = value.decode("latin-1").partition(" ")
                # digests compared in constant time: the token's length leaks nothing
                return scheme.lower() == "bearer" and hmac.compare_digest(
                    _digest(token.strip()), self._digest or b""
                )
        return False

    def _log(self, scope: Scope) -> None:
        self.refused += 1
        now = self.clock()
        if now - self._logged_at < LOG_EVERY_S:
            self._unlogged += 1
            return
        client = scope.get("client") or ("?", 0)
        more = f" ({self._unlogged} more since the last line)" if self._unlogged else ""
        log.warning(
            "refused %s %s from %s: no fleet token (Authorization: Bearer; $%s)%s",
            scope.get("method", "?"),
            scope["path"],
            client[0],
            ENV_FLEET_TOKEN,
            more,
        )
        self._logged_at, self._unlogged = now, 0


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


async def _unauthorized(send: Send) -> None:
    """401, with an error body shaped as the OpenAI API's (and vLLM's) errors are."""
    message = "this replica answers only its fleet: send the fleet's token as a bearer token"
    body = json.dumps(
        {"error": {"message": message, "type": "Unauthorized", "param": None, "code": 401}}
    ).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (b"www-authenticate", b"Bearer"),
    ]
    await send({"type": "http.response.start", "status": 401, "headers": headers})
    await send({"type": "http.response.body", "body": body})
