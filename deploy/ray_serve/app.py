"""Our replicas as a Ray Serve application, routed by prefix-router's request router.

    serve run deploy/ray_serve/serve_config.yaml          # or: serve deploy ...
    prefix-router serve-config --replicas 4 --run         # writes such a file and runs it

Two deployments: ``OpenAIIngress``, an OpenAI-compatible ingress (``/v1/completions``,
``/v1/chat/completions``, ``/stats``, ``/dashboard``, ``/engines``, ``/health``) that
Serve's HTTP proxy calls; and ``PrefixEngine``, our simulated engine, one replica per
engine, that Serve places, scales (``autoscaling_config``) and restarts. The ingress
calls the engine deployment through a handle whose request router is the
application's ``router`` argument (``ROUTERS`` in deploy/ray_serve/config.py): ours
(``prefix``, deploy/ray_serve/request_router.py), Serve's default (``pow2``, power of
two choices) or Ray Serve LLM's ``PrefixCacheAffinityRouter`` (``prefix_affinity``),
so the three compare on one application.

Each engine replica runs the replica's own HTTP server in its process (as a Ray actor
does in deploy/replicas.py) and relays to it the completions Serve sends: so its KV
events, load reports and card are the ones our gateway reads, and the request router
reads them the same way.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any, cast

import aiohttp
from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from fastapi.staticfiles import StaticFiles
from ray import serve
from ray.serve.config import RequestRouterConfig
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator

from deploy.ray_serve import directory, views
from deploy.ray_serve.batching import DEFAULT_INTERVAL_MS, gathered
from deploy.ray_serve.calls import CompletionCall
from deploy.ray_serve.config import ENGINE, INGRESS, ROUTERS, ServeApp
from deploy.replicas import SimReplica
from replica.api.config import ReplicaConfig
from replica.api.fleet_token import bearer, fleet_token
from router.http.dashboard import STATIC

#: Requests Serve sends one engine replica at a time: the gateway's default per
#: replica (an engine batches them; Serve's default of 5 would starve it).
MAX_ONGOING_REQUESTS = 128


class EngineReplica:
    """One replica of the engine deployment: our simulated engine's HTTP server in the
    Serve replica's process, to which it relays each completion."""

    def __init__(
        self,
        engine: dict[str, Any] | None = None,
        stream_batching_interval_ms: float = DEFAULT_INTERVAL_MS,
    ) -> None:
        self.token = fleet_token()
        self.server = SimReplica(ReplicaConfig(**(engine or {})), fleet_token=self.token)
        self._session: aiohttp.ClientSession | None = None
        self._interval_s = stream_batching_interval_ms / 1000

    async def record_replica_metadata(self) -> dict[str, str]:
        """Said once, when the replica is ready: where its server answers (the request
        router reads its card, KV events and load there). Also written in the
        application's directory, where the ingress's ``/engines`` lists it whatever
        the router."""
        url = await self.server.url()
        directory.enter(url)
        return {"url": url}

    def __del__(self) -> None:
        # Serve stops the replica gracefully: it leaves the directory
        with contextlib.suppress(Exception):
            directory.leave()

    async def check_health(self) -> None:
        await self.server.url()  # restarts the server if it stopped

    async def complete(self, call: CompletionCall) -> AsyncIterator[Any]:
        """The server's answer to ``call``: its status and content type first, then its
        body as it streams, its tokens after the first gathered per interval
        (deploy/ray_serve/batching.py)."""
        url = await self.server.url()
        headers = {**call.headers, **bearer(self.token)}
        async with self.session.post(url + call.path, data=call.raw, headers=headers) as answer:
            yield answer.status, answer.content_type
            async for chunk in gathered(answer.content, self._interval_s):
                yield chunk

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:  # made in Serve's event loop, on the first request
            timeout = aiohttp.ClientTimeout(total=None, sock_read=600)
            self._session = aiohttp.ClientSession(timeout=timeout)
        return self._session


ingress_app = FastAPI(title="prefix-router on Ray Serve")
ingress_app.mount("/dashboard/static", StaticFiles(directory=STATIC), name="dashboard-static")


@serve.ingress(ingress_app)
class OpenAIIngress:
    """The OpenAI-compatible front of the application: each completion goes to an
    engine replica through the handle, whose request router chooses it.

    Serve ships this class by value (``serve.ingress`` makes it anew), and with it
    copies of the module's globals it names: what it shares with this process it
    reaches through modules (``views``, ``directory``, sent by name), and its helpers
    are its own methods."""

    def __init__(self, engine: DeploymentHandle) -> None:
        self.engine = engine.options(stream=True)

    @ingress_app.post("/v1/completions")
    async def completions(self, request: Request) -> Response:
        return await self._relay(request, "/v1/completions")

    @ingress_app.post("/v1/chat/completions")
    async def chat_completions(self, request: Request) -> Response:
        return await self._relay(request, "/v1/chat/completions")

    @ingress_app.get("/stats")
    async def stats(self) -> Response:
        """This ingress replica's request router, as the gateway's ``/stats``."""
        return await views.stats(ENGINE)

    @ingress_app.get("/dashboard", include_in_schema=False)
    async def dashboard(self) -> Response:
        """The gateway's dashboard, drawn from this ingress replica's request router."""
        return views.dashboard()

    @ingress_app.get("/dashboard/data", include_in_schema=False)
    async def dashboard_data(self, since: float = 0.0, text: bool = False) -> Response:
        return await views.dashboard_data(ENGINE, since, text)

    @ingress_app.get("/engines")
    async def engines(self) -> list[str]:
        """The engine replicas' own URLs (their ``/stats``, ``/reset``), as each wrote
        them in the application's directory."""
        return directory.app_engine_urls()

    @ingress_app.get("/health")
    async def health(self) -> dict[str, str]:
        return {"status": "ok"}

    async def _relay(self, request: Request, path: str) -> Response:
        call = CompletionCall.of(path, await request.body(), request.headers)
        answer = cast(DeploymentResponseGenerator, self.engine.complete.remote(call))
        status, content_type = await answer.__anext__()
        return StreamingResponse(self._chunks(answer), status_code=status, media_type=content_type)

    @staticmethod
    async def _chunks(answer: DeploymentResponseGenerator) -> AsyncIterator[bytes]:
        async for chunk in answer:
            yield chunk


def build_app(args: dict[str, Any]) -> serve.Application:
    """The application, from ``serve run``'s arguments (the config file's ``args``:
    :meth:`ServeApp.args <deploy.ray_serve.config.ServeApp.args>`)."""
    app = ServeApp(**args)
    scaling = app.autoscaling_config()
    routed_by = RequestRouterConfig(
        # an import path, which Serve's pydantic field takes (its annotation says a dict)
        request_router_class=ROUTERS[app.router],  # type: ignore[arg-type]
        request_router_kwargs=app.router_kwargs,
    )
    engine = serve.deployment(
        name=ENGINE,
        num_replicas="auto" if scaling else app.replicas,
        autoscaling_config=scaling,
        max_ongoing_requests=MAX_ONGOING_REQUESTS,
        ray_actor_options={"num_cpus": 0},
        request_router_config=routed_by,
    )(EngineReplica)
    ingress = serve.deployment(
        name=INGRESS,
        max_ongoing_requests=4 * MAX_ONGOING_REQUESTS,
        ray_actor_options={"num_cpus": 0},
    )(OpenAIIngress)
    return ingress.bind(engine.bind(app.engine, app.stream_batching_interval_ms))
