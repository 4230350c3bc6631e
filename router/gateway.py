"""The HTTP gateway: the OpenAI API in front of a fleet, routing by cached prefix.

Each request is validated, tokenized with the replicas' tokenizer and chat template,
hashed at every ``stride``-th block boundary, and handed to the policy, which picks
a backend. The gateway counts the load at dispatch, forwards the request body as it
came, streams the answer back without buffering, and releases the load when the
request ends, however it ends. It stays async end to end.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
from collections import Counter, defaultdict
from collections.abc import AsyncIterator, Iterable
from contextlib import asynccontextmanager
from dataclasses import asdict, dataclass
from typing import Any

import aiohttp
import numpy as np
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry, Histogram, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from pydantic import BaseModel, ValidationError
from starlette.routing import Route

from replica import openai_api as api
from replica.hashing import block_hashes, identity_seed
from replica.tokenizer import ByteTokenizer
from router.admission import AdmissionQueue, Overloaded
from router.backends import Backend, BackendPool, follow_ray_replicas
from router.policies import (
    POLICIES,
    Policy,
    PolicyConfig,
    ReplicaState,
    RoutingRequest,
    make_policy,
)
from router.prefix_index import IndexConfig
from router.tenants import ApiKeys, Tenant, Unauthorized, tenant_salt

log = logging.getLogger(__name__)

JSON_HEADERS = {"content-type": "application/json"}
CACHED_TOKENS = re.compile(rb'"cached_tokens":\s*(\d+)')


@dataclass(frozen=True)
class GatewayConfig:
    policy: str = "cache_aware"
    #: The model name the replicas serve (it seeds block identities).
    model: str = "sim-llama3-8b"
    block_size: int = 16
    #: Hash every ``stride``-th block boundary (64 tokens).
    stride: int = 4
    #: KV blocks assumed per backend when it does not say (sizes the approximate index).
    capacity_blocks: int = 4096
    kv_events_interval_s: float = 0.05
    #: Upstream calls: connecting, the longest silence within an answer (a queued
    #: prefill, a slow stream) and the whole answer, in seconds.
    upstream_connect_timeout_s: float = 5.0
    upstream_read_timeout_s: float = 120.0
    upstream_timeout_s: float = 600.0
    seed: int = 0
    #: API keys, one ``KEY TENANT [admin]`` per line (see router/tenants.py); with
    #: ``$PREFIX_ROUTER_API_KEYS``. None configured: no authentication.
    api_keys_file: str = ""
    #: Requests in flight per replica; beyond it requests wait in the gateway's queue.
    max_outstanding_per_replica: int = 128
    #: Requests that may wait for a free replica, and for how long; beyond: 429.
    max_queued: int = 512
    queue_timeout_s: float = 30.0
    #: The largest request body and prompt accepted (413 beyond): Llama 3.1's context.
    max_request_bytes: int = 16 * 2**20
    max_prompt_tokens: int = 131_072
    #: Tries on other replicas when one fails before the client got a byte.
    max_retries: int = 2
    retry_backoff_s: float = 0.05

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"unknown policy {self.policy!r}; known: {', '.join(POLICIES)}")

    def policy_config(self) -> PolicyConfig:
        return PolicyConfig(block_size=self.block_size, index=IndexConfig(stride=self.stride))


class Metrics:
    """The gateway's Prometheus figures: a histogram observed per request, the rest
    read from the backends' counters at scrape time (nothing to look up per request)."""

    def __init__(self, gateway: Gateway) -> None:
        self.registry = CollectorRegistry()
        self._gateway = gateway
        self.registry.register(self)
        ProcessCollector(registry=self.registry)  # memory and CPU of the gateway
        self.overhead = Histogram(
            "prefix_router_gateway_overhead_seconds",
            "Time from receiving a request to sending it upstream.",
            buckets=(1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 5e-2),
            registry=self.registry,
        )

    def collect(self) -> Iterable[Metric]:
        by_policy = ["replica", "policy"]
        families = {
            "decisions": CounterMetricFamily(
                "prefix_router_routing_decisions", "Requests routed.", labels=by_policy
            ),
            "predicted": CounterMetricFamily(
                "prefix_router_predicted_cached_tokens",
                "Cached tokens the router predicted.",
                labels=by_policy,
            ),
            "actual": CounterMetricFamily(
                "prefix_router_actual_cached_tokens",
                "Cached tokens the replicas reported.",
                labels=by_policy,
            ),
        }
        outstanding = GaugeMetricFamily(
            "prefix_router_outstanding_requests", "Requests in flight.", labels=["replica"]
        )
        errors = CounterMetricFamily(
            "prefix_router_upstream_errors", "Failed upstream calls.", labels=["replica"]
        )
        for backend in self._gateway.pool.backends:
            name = backend.state.replica_id
            for key, family in families.items():
                for policy, value in getattr(backend, key).items():
                    family.add_metric([name, policy], value)
            outstanding.add_metric([name], backend.state.outstanding_requests)
            errors.add_metric([name], backend.upstream_errors)
        yield from families.values()
        yield outstanding
        yield errors
        yield from self._tenant_families()
        admission = self._gateway.admission
        yield GaugeMetricFamily(
            "prefix_router_queued_requests", "Requests waiting for a free replica.", len(admission)
        )
        yield CounterMetricFamily(
            "prefix_router_refused_requests", "Requests refused with 429.", admission.refused
        )

    def _tenant_families(self) -> Iterable[Metric]:
        for key, text in (
            ("requests", "Requests per tenant."),
            ("errors", "Failed requests per tenant."),
            ("prompt_tokens", "Prompt tokens per tenant."),
            ("cached_tokens", "Prompt tokens found in the cache, per tenant."),
        ):
            family = CounterMetricFamily(f"prefix_router_tenant_{key}", text, labels=["tenant"])
            for tenant, counts in self._gateway.tenants.items():
                family.add_metric([tenant], counts[key])
            yield family


class Gateway:
    """Routing state and the request path; :func:`create_app` wraps it in FastAPI."""

    def __init__(self, config: GatewayConfig, client: aiohttp.ClientSession) -> None:
        self.config = config
        self.tokenizer = ByteTokenizer()
        #: Per tenant: requests, errors, prompt and cached tokens.
        self.tenants: dict[str, Counter[str]] = defaultdict(Counter)
        self.rng = np.random.default_rng(config.seed)
        self.policy: Policy = self._make_policy(config.policy)
        self.pool = BackendPool(
            client,
            on_events=lambda state, events: self.policy.on_kv_events(state, events),
            on_added=lambda state: self.policy.on_replica_added(state),
            on_removed=lambda state: self.policy.on_replica_removed(state),
            poll_interval_s=config.kv_events_interval_s,
            default_capacity_blocks=config.capacity_blocks,
        )
        self.client = client
        self.admission = AdmissionQueue(config.max_queued, config.queue_timeout_s)
        self.metrics = Metrics(self)  # last: registering it reads the figures above
        self._prefilling: set[str] = set()
        self.retries = 0

    def _make_policy(self, name: str) -> Policy:
        return make_policy(name, time.monotonic, self.rng, self.config.policy_config())

    def switch_policy(self, name: str) -> None:
        """Route with ``name`` from now on; the new policy learns the fleet afresh."""
        policy = self._make_policy(name)
        for state in self.pool.states:
            policy.on_replica_added(state)
        self.policy = policy

    def routing_request(
        self, prompt: np.ndarray, cache_salt: str | None, tenant: str | None = None
    ) -> RoutingRequest:
        """Hash the prompt as a replica will: seeded by model and (tenant) salt."""
        seed = identity_seed(self.config.model, cache_salt)  # one short hash, no cache to grow
        stride_tokens = self.config.block_size * self.config.stride
        hashes = block_hashes(prompt, stride_tokens, seed)
        return RoutingRequest(api.new_id("route"), len(prompt), hashes, tenant=tenant)

    async def forward(
        self,
        path: str,
        raw: bytes,
        parsed: api.CompletionRequest | api.ChatCompletionRequest,
        routing: RoutingRequest,
        received: float,
        fields: dict[str, Any] | None = None,
    ) -> Response:
        """Send the request, as the client wrote it (with ``fields`` set), to the
        replica the policy picks; while no byte has reached the client, a failed
        replica's request is retried on another (at most ``max_retries`` times, with
        jittered exponential backoff)."""
        if not self.pool.backends:
            return JSONResponse(api.error_body("no backends to route to", 503), status_code=503)
        try:
            states = await self._admit()
        except Overloaded as error:
            headers = {"retry-after": str(error.retry_after_s)}
            return JSONResponse(api.error_body(str(error), 429), status_code=429, headers=headers)
        fields = dict(fields or {})
        if parsed.stream and not parsed.include_usage:  # ask for usage, to learn cached tokens
            fields["stream_options"] = {"include_usage": True}
        if fields:  # one rewrite of the body, only when something must change
            raw = json.dumps({**json.loads(raw), **fields}).encode()
        self.metrics.overhead.observe(time.perf_counter() - received)
        tried: set[str] = set()
        failure = UpstreamFailed("every replica is down")
        for attempt in range(self.config.max_retries + 1):
            candidates = [s for s in states if s.replica_id not in tried]
            if not candidates:
                break
            policy = self.policy
            backend = self.pool.by_state(policy.choose(routing, candidates))
            tried.add(backend.state.replica_id)
            self._dispatched(routing, backend, policy)
            try:
                return await self._attempt(path, raw, parsed, routing, backend, policy)
            except UpstreamFailed as error:
                failure = error
            if attempt < self.config.max_retries:
                self.retries += 1
                jitter = 0.5 + self.rng.random()
                await asyncio.sleep(self.config.retry_backoff_s * 2**attempt * jitter)
                states = self._available() or self.pool.states  # circuits may have opened
        message = f"no replica could serve the request: {failure}"
        return JSONResponse(api.error_body(message, 502), status_code=502)

    async def _attempt(
        self,
        path: str,
        raw: bytes,
        parsed: api.CompletionRequest | api.ChatCompletionRequest,
        routing: RoutingRequest,
        backend: Backend,
        policy: Policy,
    ) -> Response:
        """One try on one replica; raises :class:`UpstreamFailed` while retrying is safe."""
        try:
            response = await self.client.post(backend.url + path, data=raw, headers=JSON_HEADERS)
        except (aiohttp.ClientError, TimeoutError) as error:
            raise self._failed(routing, backend, policy, error) from None
        if response.status in RETRYABLE_STATUSES:
            response.release()
            self._completed(routing, backend, policy, None, failed=True)
            raise UpstreamFailed(f"{backend.url} answered {response.status}")
        if response.status != 200 or not parsed.stream:
            return await self._whole(response, routing, backend, policy)
        try:  # the first event, before the client sees anything: a failure is retryable
            first = await _first_line(response)
        except (aiohttp.ClientError, TimeoutError) as error:
            response.release()
            raise self._failed(routing, backend, policy, error) from None
        return StreamingResponse(
            self._relay(response, first, routing, backend, policy, parsed.include_usage),
            media_type="text/event-stream",
        )

    def _failed(
        self, routing: RoutingRequest, backend: Backend, policy: Policy, error: BaseException
    ) -> UpstreamFailed:
        """The replica did not answer: release the load, stop routing to it."""
        self._completed(routing, backend, policy, None, failed=True)
        self.pool.open_circuit(backend)
        return UpstreamFailed(f"{backend.url} failed: {error!r}")

    async def _whole(
        self,
        response: aiohttp.ClientResponse,
        routing: RoutingRequest,
        backend: Backend,
        policy: Policy,
    ) -> Response:
        try:
            content = await response.read()
        except (aiohttp.ClientError, TimeoutError) as error:
            raise self._failed(routing, backend, policy, error) from None
        finally:
            response.release()
        cached = None
        if response.status == 200:
            self._first_token(routing, backend)
            found = CACHED_TOKENS.search(content)  # cheaper than decoding the whole answer
            cached = int(found.group(1)) if found else None
        self._completed(routing, backend, policy, cached, failed=response.status >= 500)
        media = response.headers.get("content-type", "application/json")
        return Response(content, status_code=response.status, media_type=media)

    async def _relay(
        self,
        response: aiohttp.ClientResponse,
        first: str,
        routing: RoutingRequest,
        backend: Backend,
        policy: Policy,
        client_wants_usage: bool,
    ) -> AsyncIterator[bytes]:
        """Pass the stream through; if the replica dies mid-stream, end it with an
        error event (the client has tokens already: no silent truncation, no retry)."""
        cached: int | None = None
        failed = True
        self._first_token(routing, backend)
        try:
            lines = _lines(response)
            line: str | None = first
            while line is not None:
                if line.startswith("data: {") and '"usage"' in line:
                    chunk = json.loads(line[6:])
                    if chunk.get("usage") and not chunk.get("choices"):
                        cached = _cached_tokens(chunk["usage"])
                        if not client_wants_usage:
                            line = await anext(lines, None)
                            continue  # the gateway asked for it, the client did not
                yield (line + "\n\n").encode()
                line = await anext(lines, None)
            failed = False
        except (aiohttp.ClientError, TimeoutError) as error:
            self.pool.open_circuit(backend)
            message = f"upstream {backend.url} failed mid-stream: {error!r}"
            yield f"data: {json.dumps(api.error_body(message, 502))}\n\n".encode()
            yield b"data: [DONE]\n\n"
        finally:
            response.release()
            self._completed(routing, backend, policy, cached, failed=failed)

    async def _admit(self) -> list[ReplicaState]:
        """The replicas with a free slot, once this request's turn has come."""
        if not len(self.admission):
            states = self._available()
            if states:
                return states
        deadline = self.admission.deadline()
        while True:  # woken when a slot frees; another request may have taken it
            await self.admission.wait_turn(deadline)
            states = self._available()
            if states:
                return states

    def _available(self) -> list[ReplicaState]:
        limit = self.config.max_outstanding_per_replica
        return [s for s in self.pool.states if s.outstanding_requests < limit]

    def _dispatched(self, routing: RoutingRequest, backend: Backend, policy: Policy) -> None:
        state = backend.state
        state.outstanding_requests += 1
        state.outstanding_prefill_tokens += routing.predicted_uncached_tokens
        state.dispatched += 1
        policy.on_dispatch(routing, state)
        backend.decisions[policy.name] += 1
        self._prefilling.add(routing.request_id)

    def _first_token(self, routing: RoutingRequest, backend: Backend) -> None:
        """The prefill is done (or never will be): its tokens leave the replica's queue."""
        if routing.request_id in self._prefilling:
            self._prefilling.discard(routing.request_id)
            backend.state.outstanding_prefill_tokens -= routing.predicted_uncached_tokens

    def _completed(
        self,
        routing: RoutingRequest,
        backend: Backend,
        policy: Policy,
        cached: int | None,
        failed: bool,
    ) -> None:
        """Release the load on every path: success, upstream error, client gone."""
        self._first_token(routing, backend)
        state = backend.state
        state.outstanding_requests -= 1
        policy.on_complete(routing, state)
        self.admission.slot_freed()
        if failed:
            backend.upstream_errors += 1
        if routing.tenant is not None:
            counts = self.tenants[routing.tenant]
            counts["requests"] += 1
            counts["errors"] += failed
            if cached is not None:
                counts["prompt_tokens"] += routing.num_prompt_tokens
                counts["cached_tokens"] += cached
        if cached is not None and routing.predicted_cached_tokens is not None:
            backend.predicted[policy.name] += routing.predicted_cached_tokens
            backend.actual[policy.name] += cached
            backend.predictions[policy.name] += 1
            stride_tokens = self.config.block_size * self.config.stride
            if abs(routing.predicted_cached_tokens - cached) < stride_tokens:
                backend.close_predictions[policy.name] += 1

    def stats(self) -> dict[str, Any]:
        return {
            "policy": self.policy.name,
            "retries": self.retries,
            "refused": self.admission.refused,
            "queued": len(self.admission),
            "tenants": {
                name: {
                    **counts,
                    "token_hit_rate": counts["cached_tokens"] / counts["prompt_tokens"]
                    if counts["prompt_tokens"]
                    else None,
                }
                for name, counts in self.tenants.items()
            },
            "config": asdict(self.config),
            "backends": [
                {
                    "url": b.url,
                    "replica_id": b.state.replica_id,
                    "dispatched": b.state.dispatched,
                    "outstanding_requests": b.state.outstanding_requests,
                    "outstanding_prefill_tokens": b.state.outstanding_prefill_tokens,
                    "predicted_cached_tokens": sum(b.predicted.values()),
                    "actual_cached_tokens": sum(b.actual.values()),
                    "by_policy": {
                        name: {
                            "requests": b.decisions[name],
                            "predictions": b.predictions[name],
                            "close_predictions": b.close_predictions[name],
                        }
                        for name in b.decisions
                    },
                    "upstream_errors": b.upstream_errors,
                    "kv_events": b.events_supported,
                    "healthy": b.healthy,
                }
                for b in self.pool.backends
            ],
        }


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


async def read_capped(request: Request, limit: int) -> bytes:
    """The request body, refused with 413 as soon as it exceeds ``limit`` bytes."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise api.Rejected(f"the request body is over the limit of {limit} bytes", 413)
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise api.Rejected(f"the request body is over the limit of {limit} bytes", 413)
    return bytes(body)


class UpstreamFailed(Exception):
    """A replica failed before the client got a byte: another replica may serve it."""


#: Upstream answers worth another replica's try (the replica is overloaded or broken).
RETRYABLE_STATUSES = frozenset({500, 502, 503, 504})


async def _lines(response: aiohttp.ClientResponse) -> AsyncIterator[str]:
    """The non-empty lines of an SSE stream."""
    async for raw in response.content:
        line = raw.decode().rstrip("\r\n")
        if line:
            yield line


async def _first_line(response: aiohttp.ClientResponse) -> str:
    while True:
        raw = await response.content.readline()
        if not raw:
            raise aiohttp.ClientPayloadError("the stream ended before its first event")
        line = raw.decode().rstrip("\r\n")
        if line:
            return line


def _cached_tokens(usage: dict[str, Any] | None) -> int | None:
    if not usage:
        return None
    details = usage.get("prompt_tokens_details") or {}
    value = details.get("cached_tokens")
    return int(value) if value is not None else None


class PolicyChange(BaseModel):
    policy: str


class BackendChange(BaseModel):
    url: str
    replica_id: str | None = None
    capacity_blocks: int | None = None


def create_app(
    config: GatewayConfig | None = None,
    backends: list[str] | tuple[str, ...] = (),
    ray_replica_prefix: str | None = None,
) -> FastAPI:
    """The gateway's ASGI app, routing to ``backends`` (more can be added at run time)
    and, given ``ray_replica_prefix``, to the replica actors of the current Ray
    namespace whose names start with it (Ray must be initialised)."""
    config = config or GatewayConfig()
    keys = ApiKeys.load(config.api_keys_file or None)
    holder: dict[str, Gateway] = {}

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        connector = aiohttp.TCPConnector(limit=1024)
        timeout = aiohttp.ClientTimeout(
            total=config.upstream_timeout_s,
            connect=config.upstream_connect_timeout_s,
            sock_read=config.upstream_read_timeout_s,
        )
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as client:
            gateway = holder["gateway"] = app.state.gateway = Gateway(config, client)
            for url in backends:
                gateway.pool.add(url)
            follower = None
            if ray_replica_prefix is not None:
                task = follow_ray_replicas(gateway.pool, ray_replica_prefix)
                follower = asyncio.get_running_loop().create_task(task)
            yield
            if follower is not None:
                follower.cancel()
            await gateway.pool.close()

    app = FastAPI(title="prefix-router gateway", lifespan=lifespan)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, error: RequestValidationError) -> JSONResponse:
        return api.bad_request(error)

    @app.exception_handler(Unauthorized)
    async def unauthorized(request: Request, error: Unauthorized) -> JSONResponse:
        body = api.error_body(str(error), error.status)
        headers = {"www-authenticate": "Bearer"} if error.status == 401 else None
        return JSONResponse(body, status_code=error.status, headers=headers)

    def tenant_routing(
        request: Request, parsed: Any, prompt: np.ndarray
    ) -> tuple[RoutingRequest, dict[str, Any]]:
        """Authenticate, and seed the request's identities with its tenant's salt, in
        the gateway and (through the ``cache_salt`` field forwarded) in the replica."""
        tenant: Tenant | None = keys.tenant(request.headers.get("authorization"))
        name = tenant.name if tenant else None
        salt = tenant_salt(name, parsed.cache_salt)
        fields = {"cache_salt": salt} if salt != parsed.cache_salt else {}
        return holder["gateway"].routing_request(prompt, salt, name), fields

    def admin_only(request: Request) -> None:
        keys.admin(request.headers.get("authorization"))

    @app.exception_handler(api.Rejected)
    async def rejected(request: Request, error: api.Rejected) -> JSONResponse:
        return error.response()

    async def parse(
        request: Request, model: type[api.CompletionRequest] | type[api.ChatCompletionRequest]
    ) -> tuple[bytes, Any]:
        """The raw body (forwarded as it came) and its validated form."""
        raw = await read_capped(request, config.max_request_bytes)
        try:
            parsed = model.model_validate_json(raw)
        except ValidationError as error:
            raise RequestValidationError(error.errors()) from None
        if parsed.model is not None and parsed.model != config.model:
            raise api.Rejected(f"the model {parsed.model!r} does not exist", 404, "model")
        return raw, parsed

    def check_length(prompt: np.ndarray, field: str) -> None:
        if len(prompt) > config.max_prompt_tokens:
            message = (
                f"the prompt is {len(prompt)} tokens, over the limit of {config.max_prompt_tokens}"
            )
            raise api.Rejected(message, 413, field)

    async def completions(request: Request) -> Response:
        received = time.perf_counter()
        raw, parsed = await parse(request, api.CompletionRequest)
        gateway = holder["gateway"]
        prompt = parsed.token_ids(gateway.tokenizer)
        if prompt is None:
            return api.bad_token_ids()
        check_length(prompt, "prompt")
        routing, fields = tenant_routing(request, parsed, prompt)
        return await gateway.forward("/v1/completions", raw, parsed, routing, received, fields)

    async def chat_completions(request: Request) -> Response:
        received = time.perf_counter()
        raw, parsed = await parse(request, api.ChatCompletionRequest)
        gateway = holder["gateway"]
        prompt = gateway.tokenizer.apply_chat_template([m.model_dump() for m in parsed.messages])
        check_length(prompt, "messages")
        routing, fields = tenant_routing(request, parsed, prompt)
        return await gateway.forward("/v1/chat/completions", raw, parsed, routing, received, fields)

    # The hot paths are plain Starlette routes: they skip FastAPI's dependency
    # resolution (about 0.1 ms a request here). These FastAPI twins, never reached,
    # describe their bodies in the OpenAPI schema (clients and fuzzers read it).
    app.router.routes[0:0] = [
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
    ]

    @app.post("/v1/completions", responses=ERROR_RESPONSES)
    async def completions_schema(body: api.CompletionRequest, request: Request) -> Response:
        return await completions(request)

    @app.post("/v1/chat/completions", responses=ERROR_RESPONSES)
    async def chat_schema(body: api.ChatCompletionRequest, request: Request) -> Response:
        return await chat_completions(request)

    @app.get("/v1/models")
    async def models() -> dict:
        card = {"id": config.model, "object": "model", "created": 0, "owned_by": "prefix-router"}
        return {"object": "list", "data": [card]}

    @app.get("/health")
    async def health() -> Response:
        gateway = holder["gateway"]
        status = 200 if gateway.pool.backends else 503
        return JSONResponse(
            {"status": "ok" if status == 200 else "no backends"}, status_code=status
        )

    @app.get("/metrics")
    async def metrics() -> Response:
        registry = holder["gateway"].metrics.registry
        return Response(generate_latest(registry), media_type="text/plain; version=0.0.4")

    @app.get("/stats")
    async def stats() -> dict:
        return holder["gateway"].stats()

    @app.post("/admin/policy")
    async def set_policy(change: PolicyChange, request: Request) -> Response:
        admin_only(request)
        if change.policy not in POLICIES:
            message = f"unknown policy {change.policy!r}; known: {', '.join(POLICIES)}"
            return JSONResponse(api.error_body(message, 400, "policy"), status_code=400)
        holder["gateway"].switch_policy(change.policy)
        return JSONResponse({"policy": change.policy})

    @app.post("/admin/backends")
    async def add_backend(change: BackendChange, request: Request) -> Response:
        admin_only(request)
        try:
            backend = holder["gateway"].pool.add(
                change.url, change.replica_id, change.capacity_blocks
            )
        except ValueError as error:
            return JSONResponse(api.error_body(str(error), 400, "url"), status_code=400)
        return JSONResponse({"replica_id": backend.state.replica_id, "url": backend.url})

    @app.delete("/admin/backends")
    async def remove_backend(url: str, request: Request) -> Response:
        admin_only(request)
        if not await holder["gateway"].pool.remove(url):
            return JSONResponse(api.error_body(f"no backend {url!r}", 404, "url"), status_code=404)
        return JSONResponse({"removed": url})

    return app
