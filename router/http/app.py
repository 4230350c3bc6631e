"""The gateway's HTTP face: the OpenAI API in front of a fleet, and its admin endpoints.

Each completion request is handed whole to the gateway's request path
(``Gateway.handle``: read, resolve, admit, place, dispatch, settle; see
``router/gateway.py``); what is here is HTTP: the schema, errors, the admin and
monitoring endpoints. Handlers find the gateway in ``request.app.state``; the app's
lifespan owns the pooled HTTP client, the backends' watchers and Ray discovery.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, Response
from fastapi.staticfiles import StaticFiles
from pydantic import BaseModel
from starlette.types import Receive, Scope, Send

from replica.api import openai as api
from replica.api import stats as stats_codec
from replica.api.fleet_token import bearer
from replica.api.fleet_token import fleet_token as read_fleet_token
from replica.api.stats import KVEventsEndpoint
from router.config import GatewayConfig
from router.fair.tenants import ENV_FLEET_SECRET, ApiKeys, Unauthorized, fleet_secret
from router.fleet.backends import follow_ray_replicas, parse_backend, sync_ray_replicas
from router.gateway import Gateway
from router.http.dashboard import STATIC
from router.http.dashboard.history import History
from router.http.dashboard.view import build, replica_figures
from router.http.hot_path import HOT_PATHS, HotPathProtocol
from router.http.metrics import GatewayMetrics
from router.path.envelope import AsgiInbound, Inbound
from router.policies import POLICIES
from router.stats import for_monitoring

log = logging.getLogger(__name__)

#: The longest a gateway that follows Ray's replicas waits, before it serves, for their
#: replay buffers to be in its index (a replay is a ZMQ round trip per replica).
LEARN_TIMEOUT_S = 5.0
#: What the completion endpoints answer besides 200, for the OpenAPI schema.
ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    code: {"description": text}
    for code, text in (
        (400, "invalid request: the message names the field"),
        (401, "missing or invalid API key (when keys are configured)"),
        (404, "unknown model"),
        (413, "request body or prompt over the limit"),
        (429, "all replicas busy and the queue full: retry after Retry-After seconds"),
        (502, "no replica could serve the request"),
        (503, "no backends"),
    )
}

routes = APIRouter()


def create_app(
    config: GatewayConfig | None = None,
    backends: list[str] | tuple[str, ...] = (),
    ray_replica_prefix: str | None = None,
    secret: bytes | None = None,
    fleet_token: str | None = None,
) -> FastAPI:
    """The gateway's ASGI app, routing to ``backends`` (more can be added at run time)
    and, given ``ray_replica_prefix``, to the replica actors of the current Ray
    namespace whose names start with it (Ray must be initialised). ``secret``: the
    fleet's, that tenants' salts are keyed with; ``fleet_token``: what the replicas
    ask of their callers (each, if not given: the config's file, else the
    environment's)."""
    config = config or GatewayConfig()
    keys = ApiKeys.load(config.api_keys_file or None)
    if secret is None:
        secret = fleet_secret(config.fleet_secret_file)
    if fleet_token is None:
        fleet_token = read_fleet_token(config.fleet_token_file)
    if keys.enabled and not secret:
        log.warning(
            "tenants' cache salts are unkeyed: whoever reaches a replica can compute "
            "another tenant's; set $%s or --fleet-secret-file (serve and up make one)",
            ENV_FLEET_SECRET,
        )

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with backend_session(config, fleet_token) as client:
            gateway = app.state.gateway = Gateway(
                config, client, keys, secret=secret, fleet_token=fleet_token
            )
            app.state.metrics = GatewayMetrics(
                gateway.accounting, gateway.pool, gateway.queue, gateway.tenant_footprint
            )
            for spec in backends:
                url, kv_endpoint, role = parse_backend(spec)
                gateway.pool.add(url, kv_endpoint=kv_endpoint, role=role)
            follower = None
            if ray_replica_prefix is not None:  # serving starts with the replicas admitted
                await sync_ray_replicas(gateway.pool, ray_replica_prefix)
                await gateway.pool.learned(timeout_s=LEARN_TIMEOUT_S)
                task = follow_ray_replicas(gateway.pool, ray_replica_prefix)
                follower = asyncio.get_running_loop().create_task(task)
            yield
            if follower is not None:
                follower.cancel()
            await gateway.pool.close()
            gateway.upstream.close()

    app = GatewayApp(title="prefix-router gateway", lifespan=lifespan)
    app.state.config, app.state.keys = config, keys
    app.state.history = History(config.dashboard)
    app.add_exception_handler(RequestValidationError, _invalid)  # type: ignore[arg-type]
    app.add_exception_handler(Unauthorized, _unauthorized)  # type: ignore[arg-type]
    app.add_exception_handler(api.Rejected, _rejected)  # type: ignore[arg-type]
    app.include_router(routes)
    app.mount("/dashboard/static", StaticFiles(directory=STATIC), name="dashboard-static")
    return app


class GatewayApp(FastAPI):
    """FastAPI, with the completion endpoints taken before its middleware and routing.

    Every request of the API would otherwise cross seven middleware layers, the
    router's path matching and FastAPI's dependency resolution: a third of the
    gateway's CPU per request in front of fast replicas. Their FastAPI twins in
    ``routes``, never reached, describe the bodies in the OpenAPI schema (for
    clients and fuzzers); everything else is served by FastAPI as usual. Served by
    uvicorn with ``http_protocol`` (deploy/serving.py), the completion endpoints do
    not cross ASGI either (router/http/hot_path.py).
    """

    http_protocol = HotPathProtocol

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        hot = scope["type"] == "http" and scope["method"] == "POST"
        chat = HOT_PATHS.get(scope["path"]) if hot else None
        if chat is None:
            await super().__call__(scope, receive, send)
            return
        scope["app"] = self
        inbound = AsgiInbound(Request(scope, receive, send))
        response = await self.respond(scope["path"], chat, inbound)
        await response(scope, receive, send)

    @property
    def max_request_bytes(self) -> int:
        gateway: Gateway = self.state.gateway
        return gateway.config.max_request_bytes

    async def respond(self, path: str, chat: bool, inbound: Inbound) -> Response:
        """A completion request's answer, refusals included: the one way in for both
        HTTP servers."""
        gateway: Gateway = self.state.gateway
        try:
            return await gateway.handle(inbound, path, chat)
        except api.Rejected as error:
            return error.response()
        except Unauthorized as error:
            return unauthorized(error)


def backend_session(config: GatewayConfig, fleet_token: str) -> aiohttp.ClientSession:
    """One pooled session for the backends' health, statistics and events (carrying
    the fleet's token: the replicas answer only their fleet)."""
    timeout = aiohttp.ClientTimeout(
        total=config.upstream_timeout_s,
        connect=config.upstream_connect_timeout_s,
        sock_read=config.upstream_read_timeout_s,
    )
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=1024), timeout=timeout, headers=bearer(fleet_token)
    )


def _gateway(request: Request) -> Gateway:
    gateway: Gateway = request.app.state.gateway
    return gateway


# ----------------------------------------------------------------- errors


async def _invalid(request: Request, error: RequestValidationError) -> JSONResponse:
    return api.bad_request(error)


async def _unauthorized(request: Request, error: Unauthorized) -> JSONResponse:
    return unauthorized(error)


def unauthorized(error: Unauthorized) -> JSONResponse:
    body = api.error_body(str(error), error.status)
    headers = {"www-authenticate": "Bearer"} if error.status == 401 else None
    return JSONResponse(body, status_code=error.status, headers=headers)


async def _rejected(request: Request, error: api.Rejected) -> JSONResponse:
    return error.response()


# ----------------------------------------------------------------- the OpenAI API


@routes.post("/v1/completions", responses=ERROR_RESPONSES)
async def completions_schema(body: api.CompletionRequest, request: Request) -> Response:
    raise AssertionError("served by GatewayApp before FastAPI's routing")


@routes.post("/v1/chat/completions", responses=ERROR_RESPONSES)
async def chat_schema(body: api.ChatCompletionRequest, request: Request) -> Response:
    raise AssertionError("served by GatewayApp before FastAPI's routing")


@routes.get("/v1/models")
async def models(request: Request) -> dict[str, Any]:
    """Every model the fleet serves, then the LoRA adapters, each naming its base model
    as ``parent`` (as vLLM lists them)."""
    cards = [
        {
            "id": name,
            "object": "model",
            "created": 0,
            "owned_by": "prefix-router",
            "root": name,
            "parent": parent,
        }
        for name, parent in _gateway(request).models.names()
    ]
    return {"object": "list", "data": cards}


# ----------------------------------------------------------------- operating it


@routes.get("/health")
async def health(request: Request) -> Response:
    """Healthy while it can route: some backend's circuit is closed. Else 503, saying
    why, so that a load balancer in front sends the traffic to another gateway."""
    backends = _gateway(request).pool.backends
    routable = [b for b in backends if b.healthy]
    if routable:
        return JSONResponse({"status": "ok", "backends": len(backends), "routable": len(routable)})
    reason = (
        "no backends" if not backends else f"every backend's circuit is open ({len(backends)} down)"
    )
    return JSONResponse(
        {"status": reason, "backends": len(backends), "routable": 0}, status_code=503
    )


@routes.get("/metrics")
async def metrics(request: Request) -> Response:
    metrics: GatewayMetrics = request.app.state.metrics
    body = metrics.render(admin=_is_admin(request))
    return Response(body, media_type="text/plain; version=0.0.4")


@routes.get("/stats")
async def stats(request: Request) -> dict[str, Any]:
    figures = _gateway(request).stats()
    return stats_codec.encode(figures if _is_admin(request) else for_monitoring(figures))


def _is_admin(request: Request) -> bool:
    """The fleet's topology (backends' addresses, KV-stream endpoints, hot prefixes) and
    per-tenant figures are an administrator's when keys are configured, as on the
    dashboard; the fleet's health and load in ``/stats`` and ``/metrics`` stay open to
    monitoring. Anyone's when keys are off."""
    try:
        request.app.state.keys.admin(request.headers.get("authorization"))
    except Unauthorized:
        return False
    return True


class PolicyChange(BaseModel):
    policy: str


class BackendChange(BaseModel):
    url: str
    replica_id: str | None = None
    capacity_blocks: int | None = None
    #: Where a foreign engine publishes its KV events (vLLM's ``--kv-events-config``).
    kv_events: KVEventsEndpoint | None = None


def _admin_only(request: Request) -> None:
    request.app.state.keys.admin(request.headers.get("authorization"))


@routes.post("/admin/policy")
async def set_policy(change: PolicyChange, request: Request) -> Response:
    _admin_only(request)
    if change.policy not in POLICIES:
        message = f"unknown policy {change.policy!r}; known: {', '.join(POLICIES)}"
        return JSONResponse(api.error_body(message, 400, "policy"), status_code=400)
    _gateway(request).switch_policy(change.policy)
    return JSONResponse({"policy": change.policy})


@routes.get("/admin/cache_values")
async def cache_values(request: Request) -> Response:
    """What each backend's loss would cost the fleet's caches, as its model's policy
    says (``Policy.cache_value``): which replica a scale-in stops (deploy/scaler.py)."""
    _admin_only(request)
    return JSONResponse(_gateway(request).cache_values())


@routes.post("/admin/backends")
async def add_backend(change: BackendChange, request: Request) -> Response:
    _admin_only(request)
    try:
        backend = _gateway(request).pool.add(
            change.url, change.replica_id, change.capacity_blocks, change.kv_events
        )
    except ValueError as error:
        return JSONResponse(api.error_body(str(error), 400, "url"), status_code=400)
    return JSONResponse({"replica_id": backend.state.replica_id, "url": backend.url})


@routes.delete("/admin/backends")
async def remove_backend(url: str, request: Request) -> Response:
    _admin_only(request)
    if not await _gateway(request).pool.remove(url):
        return JSONResponse(api.error_body(f"no backend {url!r}", 404, "url"), status_code=404)
    return JSONResponse({"removed": url})


# ----------------------------------------------------------------- the dashboard


@routes.get("/dashboard", include_in_schema=False)
async def dashboard() -> Response:
    """The page itself holds no figures, so it needs no key; its data does."""
    return FileResponse(STATIC / "index.html", headers={"cache-control": "no-cache"})


@routes.get("/dashboard/data")
async def dashboard_data(request: Request, since: float = 0.0, text: bool = False) -> Response:
    """The figures of one refresh (an administrator's, when keys are configured): chart
    points after ``since`` (a previous answer's ``ts``), and, with ``text``, the first
    tokens of each hot prefix decoded (no prompt text otherwise)."""
    _admin_only(request)
    gateway, config = _gateway(request), request.app.state.config.dashboard
    replicas = await replica_figures(gateway, config.dashboard_replica_timeout_s)
    view = build(
        gateway,
        request.app.state.history,
        replicas,
        time.time(),
        since,
        text,
        config.hot_prefixes_shown,
    )
    return JSONResponse(dataclasses.asdict(view), headers={"cache-control": "no-store"})
