"""One engine replica over HTTP: the OpenAI API, Prometheus metrics and KV events.

Endpoints: ``POST /v1/completions`` and ``POST /v1/chat/completions`` (streamed as
SSE or not), ``POST /tokenize`` (vLLM's), ``GET /v1/models``, ``GET /health``,
``GET /metrics`` (vLLM's metric names), ``GET /kv_events?since=SEQ``, ``POST /reset``,
``GET /stats``, and the ``/get_model_info``, ``/get_server_info`` and ``/get_load``
probes of SGLang's router. Each handler translates HTTP into a call of one of the app's
engines (:class:`~replica.service.Replica`: the one ``X-data-parallel-rank`` names, of
a server of several, replica/data_parallel.py), or of every one. Given the fleet's
token, every endpoint but ``/health`` answers only requests that carry it
(replica/api/fleet_token.py).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import asdict
from typing import Any

from fastapi import APIRouter, FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from pydantic import BaseModel, Field

from replica.api import openai as api
from replica.api import stats as stats_codec
from replica.api.card import RANK_HEADER
from replica.api.config import ReplicaConfig
from replica.api.fleet_token import FleetTokenGuard
from replica.api.kv_events import encode_page
from replica.data_parallel import EngineRanks
from replica.service import Replica

routes = APIRouter()


def create_app(
    config: ReplicaConfig | None = None,
    kv_events_host: str | None = "127.0.0.1",
    fleet_token: str = "",
) -> FastAPI:
    """The replica's ASGI app; its engine loop starts and stops with the app, and so
    does the publisher of its KV events on ZMQ, bound to ``kv_events_host`` (``None``:
    no publisher; the events stay at ``GET /kv_events``). ``fleet_token``: what its
    callers (and it, calling its peers) must carry; empty: it answers anyone."""
    ranks = EngineRanks(config or ReplicaConfig(), fleet_token)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await ranks.start(kv_events_host)
        yield
        await ranks.stop()

    app = FastAPI(title="prefix-router replica", lifespan=lifespan)
    app.state.ranks = ranks
    app.state.replica = ranks[0]  # its first (or only) engine
    app.add_exception_handler(RequestValidationError, _invalid)  # type: ignore[arg-type]
    app.add_exception_handler(api.Rejected, _rejected)  # type: ignore[arg-type]
    app.include_router(routes)
    if fleet_token:
        app.add_middleware(FleetTokenGuard, token=fleet_token)
    return app


def _ranks(request: Request) -> EngineRanks:
    ranks: EngineRanks = request.app.state.ranks
    return ranks


def _replica(request: Request) -> Replica:
    """The engine the request's ``X-data-parallel-rank`` names, rank 0 without it."""
    return _ranks(request).named(request.headers.get(RANK_HEADER))


async def _invalid(request: Request, error: RequestValidationError) -> JSONResponse:
    return api.bad_request(error)


async def _rejected(request: Request, error: api.Rejected) -> JSONResponse:
    return error.response()


@routes.post("/v1/completions")
async def completions(body: api.CompletionRequest, request: Request) -> Response:
    replica = _ranks(request).chosen(request.headers.get(RANK_HEADER))
    return await replica.answer(body, body.prompts(replica.engine.tokenizer), str(request.base_url))


@routes.post("/v1/chat/completions")
async def chat_completions(body: api.ChatCompletionRequest, request: Request) -> Response:
    replica = _ranks(request).chosen(request.headers.get(RANK_HEADER))
    # pieces cached per salt, as the KV is: one tenant cannot time another's text
    scope = body.cache_salt
    prompt = body.prompt_ids(replica.engine.tokenizer, cache_scope=scope)
    return await replica.answer(body, [prompt], str(request.base_url))


class LendRequest(BaseModel):
    """A peer's ask (replica/peers.py): pin the blocks held for ``lease_id``, else the
    leading ``block_hashes`` this replica holds, for ``hold_s`` engine seconds."""

    lease_id: str = Field(min_length=1, max_length=256)
    block_hashes: list[int] = Field(default_factory=list, max_length=1_000_000)
    hold_s: float = Field(ge=0, le=3600)


@routes.post("/kv/lend")
async def lend(ask: LendRequest, request: Request) -> dict[str, int]:
    """How many blocks this replica lends the asking peer to pull (0: none)."""
    return {"blocks": _replica(request).lend(ask.lease_id, ask.block_hashes, ask.hold_s)}


@routes.post("/tokenize")
async def tokenize(body: api.TokenizeRequest, request: Request) -> dict[str, Any]:
    """vLLM's ``/tokenize``: the token ids this replica computes for a prompt or a
    conversation (a gateway checks its own tokenizer against them)."""
    replica = _replica(request)
    tokens = body.token_ids(replica.engine.tokenizer).tolist()
    max_len = replica.engine.config.capacity_tokens
    return {"count": len(tokens), "max_model_len": max_len, "tokens": tokens, "token_strs": None}


@routes.get("/v1/models")
async def models(request: Request) -> dict[str, Any]:
    """The model, then its LoRA adapters, each naming the model as its ``parent``, as
    vLLM lists them."""
    replica = _replica(request)
    model, max_len = replica.config.model, replica.engine.config.capacity_tokens
    base = {
        "id": model,
        "object": "model",
        "created": 0,
        "owned_by": "prefix-router",
        "root": model,
        "parent": None,
        "max_model_len": max_len,
    }
    adapters = [
        {**base, "id": name, "root": name, "parent": model}
        for name in sorted(replica.engine.adapters.registered)
    ]
    return {"object": "list", "data": [base, *adapters]}


class LoraChange(BaseModel):
    """vLLM's body for ``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` (the
    simulated engine has no weights to read: ``lora_path`` is kept for compatibility)."""

    lora_name: str = Field(min_length=1, max_length=256)
    lora_path: str = ""


@routes.post("/v1/load_lora_adapter")
async def load_lora_adapter(change: LoraChange, request: Request) -> Response:
    refused = _every_engine(request, lambda replica: replica.load_adapter(change.lora_name))
    if refused is not None:
        return JSONResponse(api.error_body(refused, 400, "lora_name"), status_code=400)
    return PlainTextResponse(f"Success: LoRA adapter '{change.lora_name}' added successfully.")


@routes.post("/v1/unload_lora_adapter")
async def unload_lora_adapter(change: LoraChange, request: Request) -> Response:
    refused = _every_engine(request, lambda replica: replica.unload_adapter(change.lora_name))
    if refused is not None:
        status = 404 if "cannot be found" in refused else 409
        return JSONResponse(api.error_body(refused, status, "lora_name"), status_code=status)
    return PlainTextResponse(f"Success: LoRA adapter '{change.lora_name}' removed successfully.")


def _every_engine(request: Request, change: Callable[[Replica], str | None]) -> str | None:
    """``change`` made on every engine; the first refusal, if one refused."""
    refusals = [change(replica) for replica in _ranks(request).all]
    return next((refused for refused in refusals if refused is not None), None)


@routes.get("/health")
async def health(request: Request) -> Response:
    failures = (replica.loop.failure for replica in _ranks(request).all)
    failure = next((failure for failure in failures if failure is not None), None)
    if failure is None:
        return JSONResponse({"status": "ok"})
    return JSONResponse({"status": f"the engine loop stopped: {failure}"}, status_code=503)


@routes.get("/metrics")
async def metrics(request: Request) -> Response:
    body = _replica(request).metrics.render()
    return Response(body, media_type="text/plain; version=0.0.4")


@routes.get("/kv_events")
async def kv_events(request: Request, since: int = Query(0, ge=0)) -> Response:
    page = _replica(request).kv_events(since)
    return Response(encode_page(page), media_type="application/json")


@routes.post("/reset")
async def reset(request: Request) -> Response:
    if not _ranks(request).reset():
        message = "requests are in flight; reset when the replica is idle"
        return JSONResponse(api.error_body(message, 409), status_code=409)
    return JSONResponse({"status": "reset"})


@routes.get("/stats")
async def stats(request: Request) -> dict[str, Any]:
    return stats_codec.encode(_replica(request).stats())


# SGLang router's worker probes.
@routes.get("/get_model_info")
async def model_info(request: Request) -> dict[str, Any]:
    model = _replica(request).config.model
    return {"model_path": model, "tokenizer_path": None, "is_generation": True}


@routes.get("/get_server_info")
async def server_info(request: Request) -> dict[str, Any]:
    config = _replica(request).config
    dp_size = config.data_parallel_size
    return {"model_path": config.model, "dp_size": dp_size, "tp_size": 1, **asdict(config)}


@routes.get("/get_load")
async def load(request: Request) -> dict[str, int]:
    return {"load": _ranks(request).load}
