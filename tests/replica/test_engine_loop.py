"""The engine loop steps the engine in real time; an error that kills it is reported."""

import asyncio

import numpy as np

from replica.engine import Engine, EngineConfig
from replica.engine_loop import EngineLoop
from replica.sequence import EngineRequest


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
