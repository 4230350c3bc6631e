"""An answer's stream gathered for its trip through Ray Serve (deploy/ray_serve/batching.py),
read from a real HTTP server that streams as an OpenAI-compatible one does."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable

import aiohttp
import pytest
from aiohttp import web

from deploy.ray_serve.batching import gathered
from tests.shared import http_server

pytestmark = pytest.mark.slow  # a real HTTP server

ROLE = 'data: {"choices": [{"delta": {"role": "assistant", "content": ""}}]}\n\n'


def token(text: str) -> str:
    return "data: " + json.dumps({"choices": [{"delta": {"content": text}}]}) + "\n\n"


def streaming(
    events: list[tuple[float, str]],
) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    """A handler that streams ``events``, each that many seconds after the one before."""

    async def answer(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await response.prepare(request)
        for pause, event in events:
            await asyncio.sleep(pause)
            await response.write(event.encode())
        await response.write_eof()
        return response

    return answer


async def relay(events: list[tuple[float, str]], interval_s: float) -> list[bytes]:
    """The items ``gathered`` makes of a server's stream of ``events``."""
    async with (
        http_server("/", streaming(events)) as url,
        aiohttp.ClientSession() as session,
        session.post(url + "/", json={}) as response,
    ):
        return [item async for item in gathered(response.content, interval_s)]


def test_tokens_after_the_first_are_gathered_and_nothing_is_lost_or_reordered():
    tokens = [token(f"t{i}") for i in range(20)]
    events = [(0.0, ROLE), (0.2, tokens[0])] + [(0.01, t) for t in tokens[1:]]
    events.append((0.01, "data: [DONE]\n\n"))
    items = asyncio.run(relay(events, interval_s=0.1))
    assert b"".join(items).decode() == "".join(event for _, event in events)
    # the role announcement and the first token each went on their own, as they came
    assert items[0].decode() == ROLE
    assert items[1].decode() == tokens[0]
    # the 19 tokens after it (10 ms apart, 190 ms in all) in a few items, not 19
    assert len(items) - 2 <= 5


def test_an_interval_of_zero_passes_every_chunk_as_it_comes():
    events = [(0.0, ROLE)] + [(0.02, token(f"t{i}")) for i in range(5)]
    items = asyncio.run(relay(events, interval_s=0.0))
    assert [item.decode() for item in items] == [event for _, event in events]


def test_a_token_after_a_long_pause_is_not_held_back_for_company():
    # after a gathering interval with nothing in it, the next token goes as it comes
    events = [(0.0, token("a")), (0.3, token("b")), (0.3, token("c"))]
    items = asyncio.run(relay(events, interval_s=0.05))
    assert [item.decode() for item in items] == [event for _, event in events]


def test_a_reader_that_leaves_mid_answer_leaves_nothing_waiting():
    async def main() -> list[asyncio.Task]:
        long_answer = streaming([(0.01, token(f"t{i}")) for i in range(100)])
        async with (
            http_server("/", long_answer) as url,
            aiohttp.ClientSession() as session,
            session.post(url + "/", json={}) as response,
        ):
            items = gathered(response.content, 0.05)
            assert (await anext(items)).decode() == token("t0")
            await anext(items)
            await items.aclose()  # Serve closes it when the client goes
            await asyncio.sleep(0)  # (a cancelled task ends at its next turn)
            # the answer still streams, and nothing of ours waits for its end
            return [t for t in asyncio.all_tasks() if "wait_eof" in repr(t)]

    assert asyncio.run(main()) == []
