"""The engine loop steps the engine in real time; an error that kills it is reported."""

import asyncio
import json

import numpy as np
import pytest
from fastapi.testclient import TestClient

from replica.api.config import ReplicaConfig
from replica.engine import Engine, EngineConfig
from replica.engine_loop import EngineLoop
from replica.sequence import EngineRequest
from replica.server import create_app


class FaultyEngine(Engine):
    """An engine whose first step fails, as a bug or a corrupt block table would."""

    def step(self):  # type: ignore[no-untyped-def]
        raise RuntimeError("block table corrupt")


def test_a_loop_that_died_of_an_error_says_why_and_one_that_stopped_does_not():
    async def scenario() -> tuple[str | None, str | None, str | None]:
        loop = EngineLoop(FaultyEngine(EngineConfig()))
        loop.start()
        before = loop.failure
        loop.submit(EngineRequest("r", np.arange(1, 40), 4))
        for _ in range(100):
            await asyncio.sleep(0.01)
            if loop.failure:
                break
        died = loop.failure
        healthy = EngineLoop(Engine(EngineConfig()))
        healthy.start()
        await asyncio.sleep(0)
        await healthy.stop()
        return before, died, healthy.failure

    before, died, stopped = asyncio.run(scenario())
    assert before is None and stopped is None
    assert died == "RuntimeError: block table corrupt"


@pytest.mark.timeout(60)  # the bug this catches is a request waiting forever
def test_a_replica_whose_engine_died_fails_every_request_and_says_so_on_health():
    """Over HTTP, the real app: requests waiting when the engine dies, and later ones,
    get vLLM's 500 (a stream an error event), none hangs; /health turns 503."""
    app = create_app(ReplicaConfig(host_blocks=0), kv_events_host=None)  # real time
    engine = app.state.replica.engine
    body = {"prompt": "doomed " * 20, "max_tokens": 5000, "ignore_eos": True}  # seconds

    def corrupt(*_: object) -> None:
        raise RuntimeError("block table corrupt")

    with TestClient(app, raise_server_exceptions=False) as client:
        assert client.get("/health").status_code == 200
        with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as stream:
            lines = stream.iter_lines()
            assert next(lines).startswith("data: {")  # streaming, then the engine dies
            engine.step = corrupt
            rest = [line for line in lines if line]
        assert "the engine loop stopped: RuntimeError: block table corrupt" in rest[-2]
        assert json.loads(rest[-2].removeprefix("data: "))["error"]["code"] == 500
        assert rest[-1] == "data: [DONE]"
        later = client.post("/v1/completions", json=body)
        assert later.status_code == 500 and "block table corrupt" in later.text
        health = client.get("/health")
        assert health.status_code == 503 and "block table corrupt" in health.text
