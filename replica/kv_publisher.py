"""A replica's KV events and load, pushed on ZMQ as vLLM's ``ZmqEventPublisher`` pushes them.

Two sockets, bound to free ports of the replica's address:

- PUB: after every engine step that changed the cache, one ``KVEventBatch`` as the
  multipart message (topic, 8-byte big-endian batch number, msgpack payload), in
  vLLM's encoding (``replica/api/kv_wire.py``); and, at least every
  ``load_interval_s`` and whenever it changes, the replica's load on the ``load``
  topic (running and waiting requests, queued prefill tokens), which every gateway
  combines with its own dispatches;
- ROUTER: vLLM's replay socket. A subscriber that sees a gap sends the first batch
  number it missed (8 bytes, big-endian) and receives every batch from there still in
  the buffer, then an end marker (batch number -1, empty payload).

Gateways find the endpoints in the replica's ``/stats`` (``kv_events``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import replace

import msgspec
import zmq
import zmq.asyncio

from replica.api.kv_wire import encode_batch
from replica.api.stats import KVEventsEndpoint, LoadReport
from replica.event_log import EventLog

log = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)
LOAD_TOPIC = b"load"


class KVPublisher:
    def __init__(
        self,
        events: EventLog,
        block_size: int,
        load: Callable[[], LoadReport],
        host: str = "127.0.0.1",
        topic: str = "kv-events",
        buffer_batches: int = 10_000,
        load_interval_s: float = 0.05,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._events, self._block_size, self._load = events, block_size, load
        self._host, self._topic = host, topic.encode()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_batches)
        self._load_interval = load_interval_s
        self._clock = clock
        self._context = zmq.asyncio.Context()
        self._pub: zmq.asyncio.Socket | None = None
        self._replay: zmq.asyncio.Socket | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._published_seq = events.last_seq  # the event log's number, not the batch's
        self._next_batch = 0
        self._next_load = 0
        self._last_load: LoadReport | None = None
        self.endpoint: KVEventsEndpoint | None = None

    async def start(self) -> KVEventsEndpoint:
        pub = self._pub = self._context.socket(zmq.PUB)
        pub.setsockopt(zmq.SNDHWM, 100_000)
        pub.setsockopt(zmq.LINGER, 0)
        replay = self._replay = self._context.socket(zmq.ROUTER)
        replay.setsockopt(zmq.LINGER, 0)
        address = f"tcp://{self._host}"
        pub_port = pub.bind_to_random_port(address)
        replay_port = replay.bind_to_random_port(address)
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._serve_replays()), loop.create_task(self._tick())]
        self.endpoint = KVEventsEndpoint(
            f"{address}:{pub_port}", f"{address}:{replay_port}", self._topic.decode()
        )
        return self.endpoint

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for socket in (self._pub, self._replay):
            if socket is not None:
                socket.close(linger=0)
        self._context.term()

    def flush(self) -> None:
        """Publish the events logged since the last batch (called after every step)."""
        if self._pub is None or self._events.last_seq == self._published_seq:
            self.publish_load(only_if_changed=True)
            return
        events, _ = self._events.since(self._published_seq)
        self._published_seq = self._events.last_seq
        payload = encode_batch(events, self._clock(), self._block_size)
        seq = self._next_batch
        self._next_batch += 1
        self._buffer.append((seq, payload))
        self._send((self._topic, seq.to_bytes(8, "big"), payload))
        self.publish_load(only_if_changed=True)

    def publish_load(self, only_if_changed: bool = False) -> None:
        report = self._load()
        if only_if_changed and report == self._last_load:
            return
        self._last_load = report
        report = replace(report, batches=self._next_batch)
        seq = self._next_load
        self._next_load += 1
        self._send((LOAD_TOPIC, seq.to_bytes(8, "big"), msgspec.msgpack.encode(report)))

    def _send(self, frames: tuple[bytes, bytes, bytes]) -> None:
        assert self._pub is not None
        with contextlib.suppress(zmq.Again):  # a full queue drops, as PUB does; gaps replay
            self._pub.send_multipart(frames, flags=zmq.NOBLOCK)

    async def _tick(self) -> None:
        """The load at least every ``load_interval_s``: the heartbeat gateways watch."""
        while True:
            await asyncio.sleep(self._load_interval)
            self.publish_load()

    async def _serve_replays(self) -> None:
        assert self._replay is not None
        while True:
            frames = await self._replay.recv_multipart()
            if len(frames) < 2:
                continue
            client, start = frames[0], int.from_bytes(frames[-1], "big")
            for seq, payload in list(self._buffer):
                if seq >= start:
                    await self._replay.send_multipart(
                        (client, b"", seq.to_bytes(8, "big"), payload)
                    )
            await self._replay.send_multipart((client, b"", END_SEQ, b""))
