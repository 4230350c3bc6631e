"""One engine replica over HTTP: the OpenAI API, Prometheus metrics and KV events.

Endpoints: ``POST /v1/completions`` and ``POST /v1/chat/completions`` (streamed as
SSE or not), ``GET /v1/models``, ``GET /health``, ``GET /metrics`` (vLLM's metric
names), ``GET /kv_events?since=SEQ``, ``POST /reset``, ``GET /stats``, and the
``/get_model_info``, ``/get_server_info`` and ``/get_load`` probes of SGLang's router.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import AsyncIterator, Callable, Iterable
from contextlib import asynccontextmanager
from dataclasses import asdict, dataclass

from fastapi import FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from replica import openai_api as api
from replica.cost_model import DEFAULT_PROFILE
from replica.engine import Engine, EngineConfig, RequestOutput
from replica.engine_loop import EngineLoop
from replica.scheduler import SchedulerConfig
from replica.sequence import EngineRequest


@dataclass(frozen=True)
class ReplicaConfig:
    """A replica: its engine's shape and how fast simulated time runs."""

    model: str = "sim-llama3-8b"
    num_blocks: int = 4096
    block_size: int = 16
    profile: str = DEFAULT_PROFILE
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    #: Simulated GPU time runs this many times faster than the wall clock.
    speedup: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.speedup <= 0:
            raise ValueError("speedup must be positive")
        self.engine_config()  # validates the rest

    def engine_config(self) -> EngineConfig:
        scheduler = SchedulerConfig(self.max_num_batched_tokens, self.max_num_seqs)
        return EngineConfig(
            self.model, self.num_blocks, self.block_size, self.profile, scheduler, seed=self.seed
        )


TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0)


class EngineCollector:
    """Reads the engine's figures at scrape time, under vLLM's metric names."""

    def __init__(self, engine: Engine, model: str) -> None:
        self.engine, self.model = engine, model

    def collect(self) -> Iterable[Metric]:
        engine, stats = self.engine, self.engine.cache_stats
        counters = (
            (
                "vllm:prefix_cache_queries",
                "Prompt tokens looked up in the cache.",
                stats.query_tokens,
            ),
            (
                "vllm:prefix_cache_hits",
                "Prompt tokens found in the prefix cache.",
                stats.hit_tokens,
            ),
            ("vllm:prompt_tokens", "Prompt tokens processed.", stats.query_tokens),
            ("prefix_router:evictions", "Blocks evicted from the cache.", stats.evictions),
            ("prefix_router:preemptions", "Requests preempted.", engine.scheduler.num_preemptions),
        )
        gauges = (
            ("vllm:kv_cache_usage_perc", "Fraction of KV blocks pinned.", engine.cache.usage),
            ("vllm:num_requests_running", "Requests in the running batch.", engine.num_running),
            ("vllm:num_requests_waiting", "Requests waiting to be scheduled.", engine.num_waiting),
        )
        for name, doc, value in counters:
            counter = CounterMetricFamily(name, doc, labels=["model_name"])
            counter.add_metric([self.model], value)
            yield counter
        for name, doc, number in gauges:
            gauge = GaugeMetricFamily(name, doc, labels=["model_name"])
            gauge.add_metric([self.model], number)
            yield gauge


def create_app(config: ReplicaConfig | None = None) -> FastAPI:
    """The replica's ASGI app; its engine loop starts and stops with the app."""
    config = config or ReplicaConfig()
    engine = Engine(config.engine_config())
    loop = EngineLoop(engine, config.speedup)
    registry = CollectorRegistry()
    registry.register(EngineCollector(engine, config.model))
    ttft = Histogram(
        "vllm:time_to_first_token_seconds",
        "Time to first token.",
        ["model_name"],
        buckets=TTFT_BUCKETS,
        registry=registry,
    ).labels(config.model)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        loop.start()
        yield
        await loop.stop()

    app = FastAPI(title="prefix-router replica", lifespan=lifespan)
    app.state.engine, app.state.loop, app.state.config = engine, loop, config
    served = {"requests": 0, "errors": 0}

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, error: RequestValidationError) -> JSONResponse:
        return api.bad_request(error)

    def run(
        engine_request: EngineRequest, stream: bool, include_usage: bool, chat: bool
    ) -> Response:
        try:
            outputs = loop.submit(engine_request)
        except ValueError as error:
            served["errors"] += 1
            return JSONResponse(api.error_body(str(error), 400), status_code=400)
        served["requests"] += 1
        started = time.monotonic()

        def first_token() -> None:
            ttft.observe(time.monotonic() - started)

        if stream:
            body = sse(
                engine_request.request_id, config.model, outputs, include_usage, chat, first_token
            )
            return StreamingResponse(body, media_type="text/event-stream")
        return collected_response(
            engine_request.request_id, config.model, outputs, chat, first_token
        )

    def decode(token_ids: list[int]) -> str:
        return engine.tokenizer.decode(token_ids)

    async def sse(
        request_id: str,
        model: str,
        outputs: AsyncIterator[RequestOutput],
        include_usage: bool,
        chat: bool,
        first_token: Callable[[], None],
    ) -> AsyncIterator[str]:
        if chat:
            yield event(
                api.chat_chunk(request_id, model, {"role": "assistant", "content": ""}, None)
            )
        last: RequestOutput | None = None
        async for output in outputs:
            if last is None:
                first_token()
            last = output
            text = decode(output.new_token_ids)
            if chat:
                chunk = api.chat_chunk(request_id, model, {"content": text}, output.finish_reason)
            else:
                chunk = api.completion_chunk(request_id, model, text, output.finish_reason)
            yield event(chunk)
        if include_usage and last is not None:
            kind = "chat.completion.chunk" if chat else "text_completion"
            yield event(api.usage_chunk(request_id, model, kind, usage_of(last)))
        yield "data: [DONE]\n\n"

    def collected_response(
        request_id: str,
        model: str,
        outputs: AsyncIterator[RequestOutput],
        chat: bool,
        first_token: Callable[[], None],
    ) -> Response:
        async def body() -> AsyncIterator[bytes]:
            tokens: list[int] = []
            last: RequestOutput | None = None
            async for output in outputs:
                if last is None:
                    first_token()
                last = output
                tokens += output.new_token_ids
            assert last is not None
            build = api.chat_body if chat else api.completion_body
            payload = build(request_id, model, decode(tokens), last.finish_reason, usage_of(last))
            yield json.dumps(payload).encode()

        return StreamingResponse(body(), media_type="application/json")

    @app.post("/v1/completions")
    async def completions(body: api.CompletionRequest) -> Response:
        prompt = body.token_ids(engine.tokenizer)
        if prompt is None:
            return api.bad_token_ids()
        request = EngineRequest(
            api.new_id("cmpl"), prompt, body.token_limit(), body.ignore_eos, body.cache_salt
        )
        return run(request, body.stream, body.include_usage, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: api.ChatCompletionRequest) -> Response:
        messages = [m.model_dump() for m in body.messages]
        prompt = engine.tokenizer.apply_chat_template(messages)
        request = EngineRequest(
            api.new_id("chatcmpl"), prompt, body.token_limit(), body.ignore_eos, body.cache_salt
        )
        return run(request, body.stream, body.include_usage, chat=True)

    @app.get("/v1/models")
    async def models() -> dict:
        card = {
            "id": config.model,
            "object": "model",
            "created": 0,
            "owned_by": "prefix-router",
            "max_model_len": engine.config.capacity_tokens,
        }
        return {"object": "list", "data": [card]}

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(registry), media_type="text/plain; version=0.0.4")

    @app.get("/kv_events")
    async def kv_events(since: int = Query(0, ge=0)) -> dict:
        events, lost = engine.cache.events_since(since)
        return {
            "events": [asdict(e) for e in events],
            "last_seq": engine.cache.last_event_seq,
            "lost": lost,
            "block_size": config.block_size,
        }

    @app.post("/reset")
    async def reset() -> Response:
        if not engine.reset_cache():
            message = "requests are in flight; reset when the replica is idle"
            return JSONResponse(api.error_body(message, 409), status_code=409)
        served.update(requests=0, errors=0)
        return JSONResponse({"status": "reset"})

    @app.get("/stats")
    async def stats() -> dict:
        cache = engine.cache
        return {
            "model": config.model,
            "pid": os.getpid(),
            "config": asdict(config),
            "requests": served["requests"],
            "errors": served["errors"],
            "running": engine.num_running,
            "waiting": engine.num_waiting,
            "cache": {
                **asdict(cache.stats),
                "token_hit_rate": cache.stats.token_hit_rate,
                "block_hit_rate": cache.stats.block_hit_rate,
                "num_blocks": cache.num_blocks,
                "cached_blocks": cache.num_cached_blocks,
                "usage": cache.usage,
            },
            "preemptions": engine.scheduler.num_preemptions,
            "steps": engine.num_steps,
            "busy_s": engine.busy_s,
        }

    # SGLang router's worker probes.
    @app.get("/get_model_info")
    async def model_info() -> dict:
        return {"model_path": config.model, "tokenizer_path": None, "is_generation": True}

    @app.get("/get_server_info")
    async def server_info() -> dict:
        return {"model_path": config.model, "dp_size": 1, "tp_size": 1, **asdict(config)}

    @app.get("/get_load")
    async def load() -> dict:
        return {"load": engine.num_running + engine.num_waiting}

    return app


def event(chunk: dict) -> str:
    return f"data: {json.dumps(chunk)}\n\n"


def usage_of(output: RequestOutput) -> dict:
    return api.usage(output.num_prompt_tokens, output.num_output_tokens, output.num_cached_tokens)
