"""A replica's KV events and load, pushed on ZMQ as vLLM's ``ZmqEventPublisher`` pushes them.

Three sockets, bound to free ports of the replica's address:

- events (PUB), vLLM's stream and nothing else: after every engine step that changed
  the cache, one ``KVEventBatch`` as the multipart message (topic, 8-byte big-endian
  batch number, msgpack payload) in vLLM's encoding (``replica/api/kv_wire.py``);
- load (PUB), our addition: the replica's :class:`LoadReport` as one msgpack frame,
  sent when it changes and at least every ``load_interval_s`` with the number of
  batches sent so far, so a subscriber notices a gap even while the cache is still.
  It is the stream's heartbeat. One frame, so a subscriber can keep only the latest
  (``ZMQ_CONFLATE``) and never wake for a heartbeat it does not need;
- replay (ROUTER): vLLM's replay socket. A subscriber that missed batches sends the
  first number it missed (8 bytes, big-endian) and receives every batch from there
  still in the buffer, then an end marker (-1, empty payload).

The engine loop writes the events and, on change, the load; a small thread sends the
heartbeat and serves the replay. Gateways find the endpoints in the replica's
``/stats`` (``kv_events``).
"""

from __future__ import annotations

import contextlib
import math
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import replace

import msgspec
import zmq

from replica.api.kv_wire import encode_batch
from replica.api.stats import KVEventsEndpoint, LoadReport
from replica.event_log import EventLog

END_SEQ = (-1).to_bytes(8, "big", signed=True)


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
        rank: int | None = None,
    ) -> None:
        """``rank``: the data-parallel engine whose events these are, marked on every
        batch (``None``: the server's only engine)."""
        self._events, self._block_size, self._load = events, block_size, load
        self._rank = rank
        self._host, self._topic = host, topic.encode()
        self._interval = load_interval_s
        self._clock = clock
        self._context = zmq.Context()
        self._events_pub = self._context.socket(zmq.PUB)
        self._load_pub = self._context.socket(zmq.PUB)
        #: The load socket is written by the loop (on change) and the thread (heartbeat).
        self._load_lock = threading.Lock()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_batches)
        self._buffer_lock = threading.Lock()  # the loop appends, the thread replays
        self._published_seq = events.last_seq  # the event log's number, not the batch's
        self._next_batch = 0
        self._last_load: LoadReport | None = None
        self._load_frame = b""
        self._running = False
        self._thread: threading.Thread | None = None
        self.endpoint: KVEventsEndpoint | None = None

    def start(self, at: KVEventsEndpoint | None = None) -> KVEventsEndpoint:
        """Bind the sockets to free ports, or to ``at``'s (an engine restarted where the
        last one published, as a vLLM server's fixed ports are: its batches start over
        at 0 for the subscribers still connected there)."""
        address = f"tcp://{self._host}"
        for socket in (self._events_pub, self._load_pub):
            socket.setsockopt(zmq.SNDHWM, 100_000)
            socket.setsockopt(zmq.LINGER, 0)
        replay = self._context.socket(zmq.ROUTER)
        replay.setsockopt(zmq.LINGER, 0)
        if at is None:
            events_port = self._events_pub.bind_to_random_port(address)
            load_port = self._load_pub.bind_to_random_port(address)
            replay_port = replay.bind_to_random_port(address)
            at = KVEventsEndpoint(
                f"{address}:{events_port}",
                f"{address}:{replay_port}",
                self._topic.decode(),
                f"{address}:{load_port}",
            )
        else:
            self._events_pub.bind(at.endpoint)
            self._load_pub.bind(at.load_endpoint)
            replay.bind(at.replay_endpoint)
        self.endpoint = at
        self.publish_load()
        self._running = True
        # The replay socket is handed over before the thread starts and used only there.
        self._thread = threading.Thread(
            target=self._serve, args=(replay,), name="kv-publisher", daemon=True
        )
        self._thread.start()
        return self.endpoint

    def stop(self) -> None:
        self._running = False
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._events_pub.close(linger=0)
        self._load_pub.close(linger=0)
        self._context.term()

    # ----------------------------------------------------------------- the engine loop's

    def flush(self) -> None:
        """Publish the events logged since the last batch (called after every step),
        and the load if it changed."""
        if self._events.last_seq != self._published_seq:
            events, _ = self._events.since(self._published_seq)
            self._published_seq = self._events.last_seq
            payload = encode_batch(events, self._clock(), self._block_size, self._rank)
            seq = self._next_batch
            with self._buffer_lock:
                self._buffer.append((seq, payload))
                self._next_batch += 1
            with contextlib.suppress(zmq.Again):  # a full queue drops, as PUB does; gaps replay
                self._events_pub.send_multipart(
                    (self._topic, seq.to_bytes(8, "big"), payload), flags=zmq.NOBLOCK
                )
        self.publish_load(only_if_changed=True)

    def withhold_for_tests(self) -> None:
        """Tests only: never publish the events logged since the last batch, as an engine
        that evicts without telling would. No batch number is spent on them, so no
        follower can tell from the stream."""
        self._published_seq = self._events.last_seq

    @property
    def batches(self) -> int:
        """KV event batches published so far (the next batch's number)."""
        return self._next_batch

    def publish_load(self, only_if_changed: bool = False) -> None:
        report = replace(self._load(), batches=self._next_batch)
        if only_if_changed and report == self._last_load:
            return
        self._last_load = report
        with self._load_lock:
            self._load_frame = msgspec.msgpack.encode(replace(report, ts=self._clock()))
            self._send_load()

    def _send_load(self) -> None:
        with contextlib.suppress(zmq.Again):
            self._load_pub.send(self._load_frame, flags=zmq.NOBLOCK)

    # ----------------------------------------------------------------- the thread's

    def _serve(self, replay: zmq.Socket) -> None:
        """The heartbeat and the replay socket."""
        poller = zmq.Poller()  # made once: ``socket.poll`` would make one per call
        poller.register(replay, zmq.POLLIN)
        try:
            next_beat = time.monotonic() + self._interval
            while self._running:
                wait_ms = math.ceil(max(next_beat - time.monotonic(), 0) * 1000)
                if poller.poll(wait_ms):
                    self._replay(replay)
                if time.monotonic() >= next_beat:
                    next_beat = time.monotonic() + self._interval
                    with self._load_lock:
                        self._send_load()
        finally:
            replay.close(linger=0)

    def _replay(self, replay: zmq.Socket) -> None:
        frames = replay.recv_multipart()
        if len(frames) < 2:
            return
        client, start = frames[0], int.from_bytes(frames[-1], "big")
        with self._buffer_lock:
            batches = [(seq, payload) for seq, payload in self._buffer if seq >= start]
        for seq, payload in batches:
            replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
        replay.send_multipart((client, b"", END_SEQ, b""))
