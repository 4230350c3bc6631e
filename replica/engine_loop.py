"""The engine in real time: a background task that steps it and streams its tokens.

The pure :class:`~replica.engine.Engine` says how long each step would take on the
simulated GPU; this loop sleeps that long (divided by ``speedup``, less the time the
step took to compute here) before handing the step's tokens to their streams, so
clients see the simulated GPU's timing. All of it runs on one asyncio event loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

from replica.engine import Engine, EngineDead, RequestOutput
from replica.sequence import EngineRequest


class EngineLoop:
    def __init__(
        self,
        engine: Engine,
        speedup: float = 1.0,
        clock: Callable[[], float] | None = None,
        on_step: Callable[[], object] | None = None,
    ) -> None:
        if speedup <= 0:
            raise ValueError("speedup must be positive")
        self.engine = engine
        self.speedup = speedup
        self._clock = clock
        #: Called after every step's tokens are handed out (the KV event publisher).
        self.on_step = on_step
        #: Each request's outputs; an :class:`EngineDead` ends them if the loop dies.
        self._streams: dict[str, asyncio.Queue[RequestOutput | EngineDead]] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="engine-loop")

    async def stop(self) -> None:
        """Stop stepping; a loop that died already stops quietly (its error was said)."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    @property
    def failure(self) -> str | None:
        """Why the loop stopped stepping, if it died of an error (the replica is then
        unhealthy, as vLLM's server is once its engine is dead)."""
        task = self._task
        if task is None or not task.done() or task.cancelled() or task.exception() is None:
            return None
        return f"{type(task.exception()).__name__}: {task.exception()}"

    @property
    def num_streams(self) -> int:
        return len(self._streams)

    def submit(self, request: EngineRequest) -> AsyncIterator[RequestOutput]:
        """Queue a request now; iterate the result for its outputs until it finishes.

        Raises ValueError (from the engine) at once if the request can never fit, and
        :class:`EngineDead` if the loop died (iterating raises it if the loop dies
        later). If the consumer stops early (a client disconnected), the request is
        aborted.
        """
        if self.failure is not None:
            raise EngineDead(f"the engine loop stopped: {self.failure}")
        self.engine.add_request(request)
        queue: asyncio.Queue[RequestOutput | EngineDead] = asyncio.Queue()
        self._streams[request.request_id] = queue
        self._wake.set()
        return self._outputs(request.request_id, queue)

    def abort(self, request_id: str) -> None:
        """Drop a queued request whose outputs nobody will read (a stream that was never
        iterated cannot abort it when closed)."""
        if self._streams.pop(request_id, None) is not None:
            self.engine.abort(request_id)

    async def _outputs(
        self, request_id: str, queue: asyncio.Queue[RequestOutput | EngineDead]
    ) -> AsyncIterator[RequestOutput]:
        finished = False
        try:
            while not finished:
                output = await queue.get()
                if isinstance(output, EngineDead):
                    raise output
                finished = output.finished
                yield output
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self.engine.abort(request_id)

    async def _run(self) -> None:
        try:
            await self._step_forever()
        except Exception as error:  # the loop is dead: no waiting request hangs on it
            dead = EngineDead(f"the engine loop stopped: {type(error).__name__}: {error}")
            for queue in self._streams.values():
                queue.put_nowait(dead)
            raise

    async def _step_forever(self) -> None:
        loop = asyncio.get_running_loop()
        clock = self._clock or loop.time
        while True:
            if not self.engine.has_unfinished:
                self._wake.clear()
                await self._wake.wait()
                continue
            started = clock()
            result = self.engine.step()
            delay = result.duration_s / self.speedup - (clock() - started)
            await asyncio.sleep(max(delay, 0.0))
            for output in result.outputs:
                if output.finished:  # the stream ends here even if nobody reads it
                    queue = self._streams.pop(output.request_id, None)
                else:
                    queue = self._streams.get(output.request_id)
                if queue is not None:
                    queue.put_nowait(output)
            if self.on_step is not None:
                self.on_step()
