"""One replica in real time: its engine loop, what it served, and its figures.

The server's handlers only translate HTTP into calls of :class:`Replica`; everything
a replica knows and does lives here, readable and testable without a web framework.
"""

from __future__ import annotations

import os
import time
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import TypeGuard

import numpy as np
import xxhash
from fastapi.responses import JSONResponse, Response, StreamingResponse

from replica.answers import Answer, AnswerSpec, ChoiceOutputs
from replica.api import kv_params
from replica.api import openai as api
from replica.api.config import ReplicaConfig
from replica.api.identity import block_hashes, identity_seed
from replica.api.kv_events import KVEventPage
from replica.api.model_tokenizer import HFTokenizer, load_tokenizer
from replica.api.stats import (
    CacheFigures,
    KVEventsEndpoint,
    LoadReport,
    ReplicaStats,
    TransferFigures,
)
from replica.api.token_cache import TokenCacheStats
from replica.api.tokenizer import Tokenizer
from replica.engine import Engine, EngineConfig, EngineDead, EngineRequest, RequestOutput
from replica.engine_loop import EngineLoop
from replica.kv_publisher import KVPublisher
from replica.metrics import ReplicaMetrics
from replica.peers import Peers

#: Engine seconds a peer holds lent blocks beyond the pull's predicted end.
PULL_MARGIN_S = 1.0


class Replica:
    """An engine, the loop that steps it in real time, and the replica's counters."""

    def __init__(
        self,
        config: ReplicaConfig,
        fleet_token: str = "",
        rank: int | None = None,
        tokenizer: Tokenizer | None = None,
    ) -> None:
        """``rank``: which of a data-parallel server's engines this is (``None``: its
        only one); ``tokenizer``: one its other engines share, else its own is loaded."""
        self.config, self.rank = config, rank
        tokenizer = tokenizer or load_tokenizer(config.tokenizer, config.chat_template)
        self.engine = Engine(EngineConfig.for_replica(config), tokenizer=tokenizer)
        self.loop = EngineLoop(self.engine, config.speedup)
        self.metrics = ReplicaMetrics(self.engine, config.model)
        self.publisher: KVPublisher | None = None
        self.requests = 0  # accepted since the last reset
        self.errors = 0  # refused since the last reset
        self.peers = Peers(fleet_token)
        self.pull_fallbacks = 0

    async def answer(
        self,
        body: api.CompletionRequest | api.ChatCompletionRequest,
        prompts: list[np.ndarray],
        base_url: str = "",
    ) -> Response:
        """Queue one engine request per choice (``n`` for each prompt) and answer as they
        run; 400 if one can never fit. ``base_url``: where the caller reached this
        replica (a prefill for a remote decode names it to its decode replica).

        A whole (non-streamed) answer's headers wait until every choice has its first
        token, so a router in front learns when the prefill ended, as a stream's first
        token tells it.
        """
        lora = self._adapter(body.model)
        chat = isinstance(body, api.ChatCompletionRequest)
        request_id = api.new_id("chatcmpl" if chat else "cmpl")
        requests = self._engine_requests(request_id, body, prompts, lora)
        extra: dict[str, object] = {}
        if body.kv_transfer_params:
            requests, extra = await self._moving_kv(body, requests, base_url)
        try:
            streams = self._submit(requests)
        except ValueError as error:
            self.errors += 1
            return JSONResponse(api.error_body(str(error), 400), status_code=400)
        except EngineDead as dead:  # vLLM's answer once its engine died: a 500
            raise api.Rejected(str(dead), 500) from None
        self.requests += 1
        started = time.monotonic()

        def first_token() -> None:
            self.metrics.ttft.observe(time.monotonic() - started)

        echoes = body.echoes(self.engine.tokenizer) if _echo(body) else []
        choices = [r // body.n for r in range(len(requests))]
        spec = AnswerSpec(
            request_id,
            lora or self.config.model,
            chat,
            choices,
            body.stop_strings,
            _logprobs(body),
            body.include_usage,
            echoes,
            extra,
        )
        answer, outputs = Answer(spec, self.engine.tokenizer, first_token), ChoiceOutputs(streams)
        if body.stream:
            return StreamingResponse(answer.stream(outputs), media_type="text/event-stream")
        try:
            pulled = await answer.first_outputs(outputs)
        except EngineDead as dead:
            await outputs.aclose()
            raise api.Rejected(str(dead), 500) from None
        return StreamingResponse(answer.whole(outputs, pulled), media_type="application/json")

    async def _moving_kv(
        self,
        body: api.CompletionRequest | api.ChatCompletionRequest,
        requests: list[EngineRequest],
        base_url: str,
    ) -> tuple[list[EngineRequest], dict[str, object]]:
        """A request's ``kv_transfer_params`` applied (replica/api/kv_params.py): a
        prefill for a remote decode holds its blocks and answers with where to pull
        them; a decode pulls them, or a peer's prefix. The engine requests, and the
        fields its whole answer carries beside the choices."""
        transfer = kv_params.parse(body.kv_transfer_params)
        if transfer is None:
            return requests, {}
        if len(requests) != 1:
            raise api.Rejected("kv_transfer_params take one prompt and n=1", 400, "n")
        request = requests[0]
        if isinstance(transfer, kv_params.RemoteDecode):
            if body.stream:
                raise api.Rejected("do_remote_decode takes a whole answer (stream false)", 400)
            blocks = len(request.prompt_token_ids) // self.config.block_size
            params = kv_params.prefill_params(base_url, request.request_id, blocks)
            return [replace(request, hold_s=self.config.kv_hold_s)], {"kv_transfer_params": params}
        lent = await self._borrow(transfer, request)
        elsewhere = transfer.lease_id is not None  # a P/D decode: the prefill counted it
        return [replace(request, pull_tokens=lent, prefilled_elsewhere=elsewhere)], {}

    async def _borrow(self, transfer: kv_params.RemotePrefill, request: EngineRequest) -> int:
        """The leading prompt tokens the peer lends ``request`` to pull (0: it computes
        them itself, a fallback if the peer was asked for any)."""
        size = self.config.block_size
        prompt = request.prompt_token_ids
        wanted = (len(prompt) - 1) // size  # the last token is computed here
        if transfer.pull_tokens is not None:
            wanted = min(wanted, transfer.pull_tokens // size)
        if wanted <= 0:
            return 0
        lease_id, hashes = transfer.lease_id, []
        if lease_id is None:  # a peer pull: the leading blocks the peer holds of the prompt
            seed = identity_seed(request.lora or self.config.model, request.cache_salt)
            lease_id = f"{request.request_id}/pull"
            hashes = block_hashes(prompt[: wanted * size], size, seed)
        now = self.loop.catch_up()
        hold_s = self.engine.pull_would_end_s(wanted * size) - now + PULL_MARGIN_S
        lent = min(await self.peers.lend(transfer, lease_id, hashes, hold_s), wanted)
        self.pull_fallbacks += lent < wanted
        return lent * size

    def lend(self, lease_id: str, block_hashes: list[int], hold_s: float) -> int:
        """Pin blocks for a peer's pull (``POST /kv/lend``), for ``hold_s`` of engine time."""
        return self.engine.lend(lease_id, block_hashes, self.loop.catch_up() + hold_s)

    def _adapter(self, model: str | None) -> str | None:
        """The LoRA adapter a request's ``model`` names (``None``: the base model), as
        vLLM reads it: none, the base model, or a loaded adapter; else 404."""
        if not model or model == self.config.model:
            return None
        if model in self.engine.adapters.registered:
            return model
        raise api.Rejected(f"the model {model!r} does not exist", 404, "model")

    def load_adapter(self, name: str) -> str | None:
        """Serve the adapter ``name`` from now on; the reason if refused."""
        if name == self.config.model or name in self.engine.adapters.registered:
            return f"The lora adapter '{name}' has already been loaded."
        self.engine.adapters.register(name)
        return None

    def unload_adapter(self, name: str) -> str | None:
        """Stop serving the adapter ``name``; the reason if refused."""
        if name not in self.engine.adapters.registered:
            return f"The lora adapter '{name}' cannot be found."
        if not self.engine.adapters.unregister(name):
            return f"The lora adapter '{name}' is in use."
        return None

    def _submit(self, requests: list[EngineRequest]) -> list[AsyncIterator[RequestOutput]]:
        """Queue every choice of every prompt at once: the engine registers a prompt's
        blocks as the step that computes them is scheduled, so the other choices of a
        prompt, admitted in that step, find them cached (one prefill per prompt, as
        vLLM's parallel sampling). Raises ValueError, with nothing left queued, if a
        prompt can never fit."""
        streams: list[AsyncIterator[RequestOutput]] = []
        try:
            for request in requests:
                streams.append(self.loop.submit(request))
        except ValueError:
            for queued in requests[: len(streams)]:  # never iterated: closing would not abort
                self.loop.abort(queued.request_id)
            raise
        return streams

    def _engine_requests(
        self,
        request_id: str,
        body: api.CompletionRequest | api.ChatCompletionRequest,
        prompts: list[np.ndarray],
        lora: str | None = None,
    ) -> list[EngineRequest]:
        """Choice ``p * n + k`` samples prompt ``p`` for the ``k``-th time, from a seed of
        its own when the request gives one (the same request then answers the same)."""
        many = len(prompts) * body.n > 1
        requests = []
        for index in range(len(prompts) * body.n):
            seed = body.seed
            sample_seed = (
                None if seed is None else xxhash.xxh3_64_intdigest(f"{seed}:{index}".encode())
            )
            requests.append(
                EngineRequest(
                    f"{request_id}-{index}" if many else request_id,
                    prompts[index // body.n],
                    body.token_limit(),
                    body.ignore_eos,
                    body.cache_salt,
                    sample_seed,
                    min_tokens=body.min_tokens,
                    logit_bias=body.token_bias,
                    lora=lora,
                )
            )
        return requests

    async def start(
        self, host: str | None = None, at: KVEventsEndpoint | None = None
    ) -> KVEventsEndpoint | None:
        """Start stepping the engine and, given the server's host, publishing its events
        (on free ports, or ``at``'s); where it publishes."""
        self.loop.start()
        if host is None:
            return None
        engine = self.engine
        self.publisher = KVPublisher(
            engine.cache.events, self.config.block_size, self._load, host, rank=self.rank
        )
        self.loop.on_step = self.publisher.flush
        return self.publisher.start(at)

    async def stop(self) -> None:
        await self.loop.stop()
        await self.peers.close()
        if self.publisher is not None:
            self.publisher.stop()

    def _load(self) -> LoadReport:
        engine = self.engine
        return LoadReport(
            engine.num_running,
            engine.num_waiting,
            engine.queued_prefill_tokens,
            free_blocks=engine.free_blocks,
            adapters=engine.adapters.resident,
            free_adapter_slots=engine.adapters.free_slots,
        )

    def reset(self) -> bool:
        """Empty the cache and the statistics; refused (``False``) while requests run."""
        if not self.engine.reset_cache():
            return False
        self.requests = self.errors = 0
        if self.publisher is not None:  # idle: no engine step will push the ``cleared``
            self.publisher.flush()
        return True

    def kv_events(self, since: int) -> KVEventPage:
        cache = self.engine.cache
        events, lost = cache.events_since(since)
        return KVEventPage(tuple(events), cache.last_event_seq, lost, self.config.block_size)

    @property
    def load(self) -> int:
        """Requests running or waiting (SGLang's router asks for it)."""
        return self.engine.num_running + self.engine.num_waiting

    def stats(self) -> ReplicaStats:
        engine = self.engine
        return ReplicaStats(
            model=self.config.model,
            pid=os.getpid(),
            config=self.config,
            requests=self.requests,
            errors=self.errors,
            running=engine.num_running,
            waiting=engine.num_waiting,
            cache=self._cache_figures(),
            preemptions=engine.scheduler.num_preemptions,
            steps=engine.num_steps,
            busy_s=engine.busy_s,
            kv_events=self.publisher.endpoint if self.publisher else None,
            kv_event_batches=self.publisher.batches if self.publisher else 0,
            adapters=tuple(sorted(engine.adapters.registered)),
            resident_adapters=engine.adapters.resident,
            adapter_loads=engine.adapters.loads,
            transfers=self._transfer_figures(),
            tokenizer_cache=_pieces_figures(engine.tokenizer),
        )

    def _transfer_figures(self) -> TransferFigures:
        moved = self.engine.transfers
        return TransferFigures(
            moved.pulls,
            moved.pulled_tokens,
            moved.pull_s,
            moved.lent_blocks,
            moved.hold_timeouts,
            self.pull_fallbacks,
        )

    def _cache_figures(self) -> CacheFigures:
        engine = self.engine
        cache, stats, host = engine.cache, engine.cache_stats, engine.host
        return CacheFigures(
            query_tokens=stats.query_tokens,
            hit_tokens=stats.hit_tokens,
            query_blocks=stats.query_blocks,
            hit_blocks=stats.hit_blocks,
            stored_blocks=stats.stored_blocks,
            evictions=stats.evictions,
            num_blocks=cache.num_blocks,
            cached_blocks=cache.num_cached_blocks,
            usage=cache.usage,
            token_hit_rate=stats.token_hit_rate if stats.query_tokens else None,
            block_hit_rate=stats.block_hit_rate if stats.query_blocks else None,
            host_hit_tokens=stats.host_hit_tokens,
            host_num_blocks=host.num_blocks if host is not None else 0,
            host_cached_blocks=len(host) if host is not None else 0,
            host_evictions=host.stats.evictions if host is not None else 0,
            bytes_to_host=engine.bytes_to_host,
            bytes_to_gpu=engine.bytes_to_gpu,
        )


def _logprobs(body: api.CompletionRequest | api.ChatCompletionRequest) -> int | None:
    """How many alternatives each token's logprobs list (``None``: no logprobs)."""
    if isinstance(body, api.ChatCompletionRequest):
        return (body.top_logprobs or 0) if body.logprobs else None
    return body.logprobs


def _echo(
    body: api.CompletionRequest | api.ChatCompletionRequest,
) -> TypeGuard[api.CompletionRequest]:
    return isinstance(body, api.CompletionRequest) and body.echo


def _pieces_figures(tokenizer: object) -> TokenCacheStats | None:
    """What a Hugging Face tokenizer's cache of chats' pieces holds (``None``: none)."""
    if isinstance(tokenizer, HFTokenizer) and tokenizer.pieces is not None:
        return tokenizer.pieces.stats()
    return None
