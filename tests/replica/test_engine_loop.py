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


def test_the_work_between_steps_counts_within_the_simulated_step_time(monkeypatch):
    """Handing a step's tokens to its streams (and their HTTP answers) takes real time
    on the host; the loop's pace is the simulated GPU's all the same, as long as that
    work fits within a step: each step ends its simulated time after the last one."""
    now = [0.0]
    real_sleep = asyncio.sleep

    async def sleep(delay: float) -> None:  # time passes only where the loop says
        now[0] += delay
        await real_sleep(0)

    monkeypatch.setattr("replica.engine_loop.asyncio.sleep", sleep)
    engine = Engine(EngineConfig())
    ends: list[float] = []
    durations: list[float] = []
    original_step = engine.step

    def step():  # type: ignore[no-untyped-def]
        result = original_step()
        durations.append(result.duration_s)
        return result

    engine.step = step  # type: ignore[method-assign]

    def handing_out() -> None:  # 5 ms of the host's work after every step
        ends.append(now[0])
        now[0] += 0.005

    async def scenario() -> None:
        loop = EngineLoop(engine, speedup=0.5, clock=lambda: now[0], on_step=handing_out)
        loop.start()
        async for _ in loop.submit(EngineRequest("r", np.arange(1, 200), 50, ignore_eos=True)):
            pass
        await loop.stop()

    asyncio.run(scenario())
    assert len(ends) >= 50 and min(durations) / 0.5 > 0.005  # each step outlasts the work
    gaps = np.diff(ends)
    assert gaps == pytest.approx(np.array(durations[1 : len(ends)]) / 0.5)
