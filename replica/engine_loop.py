"""The engine in real time: a background task that steps it and streams its tokens.

The pure :class:`~replica.engine.Engine` says how long each step would take on the
simulated GPU; this loop ends each step that long (divided by ``speedup``) after the
previous one ended, and only then hands the step's tokens to their streams, so clients
see the simulated GPU's timing. Everything done here between two steps (computing the
step, handing its tokens to dozens of streams, the HTTP answers they write, the KV
events) counts within that time, as a GPU computes while its host does the rest; the
loop runs late only when that work outlasts the step. (Counted on top, it made a live
fleet of 4 replicas with dozens of streams each slower than its twin in the replayer.)
While it idles, the engine's clock follows the wall's (times ``speedup``), so that
pulls and holds of KV (replica/kv_transfer.py) last their simulated time; an engine
whose only requests are pulling idles until the first pull ends. All of it runs on one
asyncio event loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

from replica.engine import Engine, EngineDead, RequestOutput
from replica.sequence import EngineRequest

#: How late the loop may run and still catch up (its steps then follow each other
#: without a pause): later than that, as on a machine too busy to keep the pace, it
#: starts the pace afresh rather than run a burst of steps at no simulated cost.
MAX_LAG_S = 0.25


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
        #: When the loop last began to idle (its clock), until the engine's clock caught up.
        self._idle_since: float | None = None
        #: When the step under way is due to end (its clock; ``None``: idle until now).
        self._due: float | None = None

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
        self.catch_up()
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

    def _now(self) -> float:
        return (self._clock or asyncio.get_running_loop().time)()

    def catch_up(self) -> float:
        """Move an idle engine's clock to the wall's (times ``speedup``); its time now."""
        if self._idle_since is not None:
            now = self._now()
            self.engine.advance_to(self.engine.now + (now - self._idle_since) * self.speedup)
            self._idle_since = now
        return self.engine.now

    async def _idle(self, until_s: float | None = None) -> None:
        """Wait for new work, or until the engine's time ``until_s`` (a pull's end)."""
        self._wake.clear()
        self._idle_since, self._due = self._now(), None
        timeout = None if until_s is None else max(until_s - self.engine.now, 0.0) / self.speedup
        try:
            await asyncio.wait_for(self._wake.wait(), timeout)
        except TimeoutError:
            self.catch_up()
            self.engine.advance_to(until_s or 0.0)  # not a hair short of it
        self.catch_up()
        self._idle_since = None

    async def _step_forever(self) -> None:
        clock = self._clock or asyncio.get_running_loop().time
        while True:
            if not self.engine.has_unfinished:
                await self._idle()
                continue
            started = clock()
            due = self._due
            if due is None or started - due >= MAX_LAG_S:  # idle till now, or too late
                due = started
            result = self.engine.step()
            if not result.duration_s and (pull_ends := self.engine.next_pull_s) is not None:
                await self._idle(pull_ends)  # only pulls under way
                continue
            self._due = due + result.duration_s / self.speedup
            await asyncio.sleep(max(self._due - clock(), 0.0))
            for output in result.outputs:
                if output.finished:  # the stream ends here even if nobody reads it
                    queue = self._streams.pop(output.request_id, None)
                else:
                    queue = self._streams.get(output.request_id)
                if queue is not None:
                    queue.put_nowait(output)
            if self.on_step is not None:
                self.on_step()
