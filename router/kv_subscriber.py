"""One backend's KV events and load, pushed on ZMQ in vLLM's wire format, followed in order.

The subscriber applies every ``KVEventBatch`` in batch-number order. A gap (a batch
number past the next expected, or a first batch past 0: the replica had a cache
before we listened) is filled from the publisher's replay socket; what the replay
cannot give any more is lost, so the replica's entries are dropped and the index
starts over from the batches that follow (the replica's later events re-teach it).
Silence longer than ``silence_s`` (the load heartbeat comes every 50 ms) marks the
replica stale: its entries are dropped until it speaks again.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec
import zmq
import zmq.asyncio

from replica.api.kv_events import KVEvent
from replica.api.kv_wire import decode_batch
from replica.api.stats import KVEventsEndpoint, LoadReport

log = logging.getLogger(__name__)

LOAD_TOPIC = b"load"
END_SEQ = -1


@dataclass
class StreamState:
    """What a gateway knows of one replica's stream."""

    next_batch: int | None = None  # the batch number expected next (None: none seen)
    batches: int = 0
    gaps: int = 0
    replayed: int = 0
    resyncs: int = 0
    stale: bool = False
    last_heard: float = 0.0
    #: Seconds from a batch's time stamp at the replica to its events in the index.
    latencies: list[float] = field(default_factory=list)


class KVSubscriber:
    def __init__(
        self,
        endpoint: KVEventsEndpoint,
        on_events: Callable[[list[KVEvent]], None],
        on_load: Callable[[LoadReport], None],
        context: zmq.asyncio.Context,
        silence_s: float = 1.0,
        clock: Callable[[], float] = time.time,
        keep_latencies: int = 10_000,
    ) -> None:
        self.endpoint = endpoint
        self._on_events, self._on_load = on_events, on_load
        self._context = context
        self._silence_s = silence_s
        self._clock = clock
        self._keep = keep_latencies
        self.state = StreamState()
        self._load = msgspec.msgpack.Decoder(LoadReport)

    async def run(self) -> None:
        """Follow the stream for ever (cancel the task to stop)."""
        socket = self._context.socket(zmq.SUB)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.RCVHWM, 100_000)
        socket.setsockopt(zmq.SUBSCRIBE, self.endpoint.topic.encode())
        socket.setsockopt(zmq.SUBSCRIBE, LOAD_TOPIC)
        socket.connect(self.endpoint.endpoint)
        try:
            while True:
                if not await socket.poll(self._silence_s * 1000):
                    self._silent()
                    continue
                topic, seq, payload = await socket.recv_multipart()
                self.state.last_heard = self._clock()
                if self.state.stale:
                    self.state.stale = False
                if topic == LOAD_TOPIC:
                    report = self._load.decode(payload)
                    await self._catch_up(report.batches)
                    self._on_load(report)
                else:
                    await self._batch(int.from_bytes(seq, "big"), payload)
        finally:
            socket.close(linger=0)

    def _silent(self) -> None:
        if not self.state.stale:
            log.warning(
                "KV events from %s went silent: dropping its entries", self.endpoint.endpoint
            )
            self.state.stale = True
            self._resync()

    def _resync(self) -> None:
        """Forget what the replica held: its later events teach it again."""
        self.state.resyncs += 1
        self._on_events([KVEvent(0, "cleared")])

    async def _catch_up(self, published: int) -> None:
        """The publisher says how many batches it sent: replay what we have not seen."""
        expected = self.state.next_batch or 0
        if published > expected:
            self.state.gaps += 1
            await self._replay(expected, published)
            if self.state.next_batch != published:
                self._resync()
                self.state.next_batch = published

    async def _batch(self, seq: int, payload: bytes) -> None:
        expected = self.state.next_batch
        if expected is None and seq > 0:
            expected = 0  # we joined late: ask for what came before
        if expected is not None and seq < expected:
            return  # replayed already
        if expected is not None and seq > expected:
            self.state.gaps += 1
            await self._replay(expected, seq)
            if self.state.next_batch != seq:  # the replay could not fill the gap
                self._resync()
        self._apply(seq, payload)

    def _apply(self, seq: int, payload: bytes) -> None:
        try:
            ts, events, _ = decode_batch(payload)
        except ValueError as error:
            log.warning(
                "undecodable KV event batch %d from %s: %s", seq, self.endpoint.endpoint, error
            )
            return
        self._on_events(events)
        self.state.next_batch = seq + 1
        self.state.batches += 1
        if ts and len(self.state.latencies) < self._keep:
            self.state.latencies.append(self._clock() - ts)

    async def _replay(self, start: int, until: int, timeout_s: float = 2.0) -> None:
        """Apply batches ``start`` .. ``until - 1`` from the replay socket, in order; where
        its buffer no longer holds one, drop the replica's entries and go on."""
        socket = self._context.socket(zmq.DEALER)
        socket.setsockopt(zmq.LINGER, 0)
        socket.connect(self.endpoint.replay_endpoint)
        try:
            await socket.send_multipart((b"", start.to_bytes(8, "big")))
            while await socket.poll(timeout_s * 1000):
                *_, seq_bytes, payload = await socket.recv_multipart()
                seq = int.from_bytes(seq_bytes, "big", signed=True)
                if seq == END_SEQ:
                    return
                expected = start if self.state.next_batch is None else self.state.next_batch
                if seq < expected or seq >= until:
                    continue
                if seq > expected:  # batches the buffer no longer holds
                    self._resync()
                self._apply(seq, payload)
                self.state.replayed += 1
        finally:
            socket.close(linger=0)
