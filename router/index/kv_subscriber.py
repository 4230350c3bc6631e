"""Every backend's KV events and load, pushed on ZMQ in vLLM's wire format, followed in order.

One thread follows all the streams, so a quiet fleet costs the gateway almost
nothing: it wakes when a backend's events socket has a batch (a ZMQ poller over one
SUB socket per backend), and every ``load_read_s`` (100 ms: the replicas report every
50 ms, and between reads a gateway adds its own dispatches) to read the latest load of
each backend, which waits in a SUB socket that keeps only the newest message
(``ZMQ_CONFLATE``): the heartbeats in between are dropped by ZMQ's I/O thread without
waking Python, and one that did not change is recognised by its bytes. Decoded events
are handed to the event loop in batch-number order (``deliver``); the index is only
ever touched there.

A new follower learns the publisher's replay buffer at once (a gateway that joins
late, in front of an engine whose cache is quiet, would otherwise know nothing until
its next batch). A gap (a batch number past the next expected, or batches that a load
report said were sent and that have still not come by the next report) is filled from
the publisher's replay socket; what the replay cannot give any more is lost, so the
replica's entries are dropped and the index starts over from the batches that follow.
A policy may have batches applied again (:meth:`KVStreams.replay_since`): where an
engine found fewer cached tokens than its events said, the index drops those entries
and the stream is applied again from the request's dispatch on.
Silence longer than ``silence_s`` on a stream with a heartbeat (ours) marks the replica
stale: its entries are dropped until it speaks again. An engine restarted where the last
one published (a vLLM server's fixed ports) numbers its batches from 0 again: a live
batch number at or below the last live one (the live stream is in order; only replays
repeat numbers) means a new engine, so the replica's entries are dropped at once and its
replay buffer learned, as a new follower's.
"""

from __future__ import annotations

import logging
import math
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec
import zmq

from replica.api.kv_events import KVEvent
from replica.api.kv_wire import decode_batch
from replica.api.stats import KVEventsEndpoint, LoadReport

log = logging.getLogger(__name__)

END_SEQ = -1
#: "Every batch from there on", for a replay.
ALL_LATER = 2**63 - 1
#: Latencies kept per stream for its percentiles: the latest ones.
LATENCIES_KEPT = 10_000
#: Runs ``fn(*args)`` where the index lives (``loop.call_soon_threadsafe`` in a gateway).
Deliver = Callable[..., object]


@dataclass
class StreamState:
    """What a gateway knows of one replica's stream."""

    endpoint: KVEventsEndpoint
    on_events: Callable[[list[KVEvent]], None]
    #: Runs through ``deliver`` with each new load report, and ``None`` when stale.
    on_load: Callable[[LoadReport | None], None] | None = None
    #: Runs through ``deliver`` when its batch numbers start over (a new engine).
    on_restart: Callable[[], None] | None = None
    next_batch: int | None = None  # the batch number expected next (None: none seen)
    #: The batch after the last one in the index (on the event loop, after ``on_events``).
    indexed_through: int | None = None
    batches: int = 0
    gaps: int = 0
    replayed: int = 0
    resyncs: int = 0
    #: Times its live batch numbers started over: a new engine behind the same sockets.
    restarts: int = 0
    stale: bool = False
    #: Set on the event loop once what the publisher's replay buffer held when the
    #: follower joined is in the index (at once for a publisher with no replay).
    learned: bool = False
    last_heard: float = 0.0
    load: LoadReport | None = None
    #: Seconds from a batch's time stamp at the replica to its events in the index.
    latencies: deque[float] = field(default_factory=lambda: deque(maxlen=LATENCIES_KEPT))
    _load_bytes: bytes = b""
    _promised: int = 0  # batches the last load report said were sent
    _last_live: int = -1  # the last batch number that came live (replays not counted)


@dataclass(frozen=True)
class FollowedStream:
    """One backend's stream, as its ``ReplicaState`` shows it to the policy
    (:class:`router.core.KVStream`)."""

    streams: KVStreams
    key: Any
    state: StreamState

    @property
    def indexed_through(self) -> int | None:
        return self.state.indexed_through

    def replay_since(self, batch: int) -> None:
        self.streams.replay_since(self.key, batch)


class KVStreams:
    """The thread that follows every backend's stream (see the module docstring)."""

    def __init__(
        self,
        deliver: Deliver,
        silence_s: float = 1.0,
        load_read_s: float = 0.1,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._deliver = deliver
        self._silence_s, self._load_read_s = silence_s, load_read_s
        self._clock = clock
        self._commands: queue.Queue[tuple[str, Any, Any]] = queue.Queue()
        #: Per backend: its events socket, its load socket and its state.
        self._streams: dict[Any, tuple[zmq.Socket, zmq.Socket, StreamState]] = {}
        self._by_socket: dict[zmq.Socket, StreamState] = {}
        self._loads = zmq.Poller()  # the load sockets, asked without waiting
        self._context = zmq.Context()
        self._load = msgspec.msgpack.Decoder(LoadReport)
        self._running = True
        self._thread = threading.Thread(target=self._run, name="kv-streams", daemon=True)
        self._thread.start()

    def follow(
        self,
        key: Any,
        endpoint: KVEventsEndpoint,
        on_events: Callable[[list[KVEvent]], None],
        on_load: Callable[[LoadReport | None], None] | None = None,
        next_batch: int | None = None,
        on_restart: Callable[[], None] | None = None,
    ) -> StreamState:
        """Follow a backend's stream; ``on_events`` runs through ``deliver``. The state's
        ``load`` is the latest load the backend reported. A follower that knows where it
        stopped passes ``next_batch`` and is replayed what it missed; else it learns the
        whole replay buffer. ``on_restart``: told when a new engine publishes there."""
        state = StreamState(
            endpoint,
            on_events,
            on_load,
            on_restart=on_restart,
            next_batch=next_batch,
            last_heard=self._clock(),
        )
        self._commands.put(("follow", key, state))
        return state

    def forget(self, key: Any) -> None:
        self._commands.put(("forget", key, None))

    def relearn(self, key: Any, then: Callable[[], None] | None = None) -> None:
        """Replay the backend's whole buffer again (its index entries were dropped);
        ``then`` runs through ``deliver`` once what it held is in the index."""
        self._commands.put(("relearn", key, then))

    def replay_since(self, key: Any, batch: int) -> None:
        """Apply the backend's batches from ``batch`` on again, and those after (its index
        entries for a prompt were dropped: the engine found fewer cached than its events
        said). Applying a batch twice changes nothing that the batches after it do not set
        again; one the replay buffer no longer holds is a gap that cannot be filled."""
        self._commands.put(("replay_since", key, batch))

    def catch_up(self, key: Any) -> None:
        """Ask the replay socket for every batch after the last one seen: a publisher with
        no heartbeat (vLLM) gives no other sign of a batch sent while we subscribed."""
        self._commands.put(("catch_up", key, None))

    def close(self) -> None:
        self._running = False
        self._thread.join(timeout=5)
        self._context.term()

    # ----------------------------------------------------------------- the thread

    def _run(self) -> None:
        events = zmq.Poller()
        next_read = 0.0
        try:
            while self._running:
                self._obey(events)
                wait_s = max(next_read - time.monotonic(), 0.0)
                for socket, _ in events.poll(timeout=math.ceil(wait_s * 1000)):
                    self._drain(socket)
                if time.monotonic() >= next_read:
                    next_read = time.monotonic() + self._load_read_s
                    self._read_loads()
                    self._watch_silence(self._clock())
        finally:
            for socket, load, _ in self._streams.values():
                socket.close(linger=0)
                load.close(linger=0)

    def _obey(self, events: zmq.Poller) -> None:
        while not self._commands.empty():
            command, key, given = self._commands.get_nowait()
            if command == "follow":
                state = given
                socket = self._subscriber(state.endpoint.endpoint, state.endpoint.topic.encode())
                load = self._subscriber(state.endpoint.load_endpoint, b"", latest_only=True)
                self._streams[key] = (socket, load, state)
                self._by_socket[socket] = self._by_socket[load] = state
                events.register(socket, zmq.POLLIN)
                self._loads.register(load, zmq.POLLIN)
                if state.next_batch is None:  # new: learn what the publisher holds
                    self._learn(state)
                self._deliver(setattr, state, "learned", True)  # after what it learned
            elif key in self._streams:
                socket, load, state = self._streams[key]
                if command == "relearn":
                    state.next_batch = None
                    self._learn(state)
                    if given is not None:
                        self._deliver(given)  # after what it learned
                    continue
                if command == "catch_up":
                    self._learn(state)
                    continue
                if command == "replay_since":
                    if state.endpoint.replay_endpoint:  # from there on, as if not seen yet
                        state.next_batch = given
                        self._learn(state)
                    continue
                events.unregister(socket)
                self._loads.unregister(load)
                socket.close(linger=0)
                load.close(linger=0)
                del self._streams[key], self._by_socket[socket], self._by_socket[load]

    def _subscriber(self, endpoint: str, topic: bytes, latest_only: bool = False) -> zmq.Socket:
        socket = self._context.socket(zmq.SUB)
        socket.setsockopt(zmq.LINGER, 0)
        if latest_only:
            socket.setsockopt(zmq.CONFLATE, 1)
        else:
            socket.setsockopt(zmq.RCVHWM, 100_000)
        socket.setsockopt(zmq.SUBSCRIBE, topic)
        if endpoint:  # a foreign engine publishes no load
            socket.connect(endpoint)
        return socket

    def _drain(self, socket: zmq.Socket) -> None:
        """Apply every batch waiting in a backend's events socket."""
        state = self._by_socket[socket]
        state.last_heard, state.stale = self._clock(), False
        while int(socket.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
            frames = socket.recv_multipart()
            if len(frames) == 3:
                self._batch(state, int.from_bytes(frames[1], "big"), frames[2])

    def _read_loads(self) -> None:
        for socket, _ in self._loads.poll(timeout=0):
            state = self._by_socket[socket]
            state.last_heard, state.stale = self._clock(), False
            self._load_report(state, socket.recv())

    def _load_report(self, state: StreamState, payload: bytes) -> None:
        """Take the backend's latest load; if batches it said before were sent have
        still not come, they were lost: replay them."""
        if payload != state._load_bytes:  # the same bytes as last time: nothing to decode
            state._load_bytes = payload
            state.load = self._load.decode(payload)
            if state.load.batches < state._promised:  # its count went back: a new engine
                self._restarted(state, state._promised, state.load.batches)
            if state.on_load is not None:
                self._deliver(state.on_load, state.load)
        expected = state.next_batch or 0
        if expected < state._promised:
            self._gap(state, expected, state._promised)
        state._promised = state.load.batches if state.load is not None else 0

    def _batch(self, state: StreamState, seq: int, payload: bytes) -> None:
        if seq <= state._last_live:
            self._restarted(state, state._last_live, seq)
        state._last_live = seq
        expected = state.next_batch
        if expected is None and seq > 0:
            expected = 0  # we joined late: ask for what came before
        if expected is not None and seq < expected:
            return  # replayed already
        if expected is not None and seq > expected:
            self._gap(state, expected, seq)
        self._apply(state, seq, payload)

    def _gap(self, state: StreamState, start: int, until: int) -> None:
        state.gaps += 1
        self._replay(state, start, until)
        if state.next_batch != until:  # the replay could not fill it
            self._resync(state)
            state.next_batch = until

    def _apply(self, state: StreamState, seq: int, payload: bytes, live: bool = True) -> None:
        """Decode a batch and hand it to the event loop. Only live batches time the
        stream: a replayed one is as old as the gap it fills."""
        try:
            ts, events, _ = decode_batch(payload)
        except ValueError as error:
            log.warning("undecodable KV batch %d from %s: %s", seq, state.endpoint.endpoint, error)
            return
        state.next_batch = seq + 1
        state.batches += 1
        self._deliver(self._applied, state, seq, events, ts if live else 0.0)

    def _applied(self, state: StreamState, seq: int, events: list[KVEvent], ts: float) -> None:
        """On the event loop: into the index, and how long that took since the replica."""
        state.on_events(events)
        state.indexed_through = seq + 1
        if ts:
            state.latencies.append(self._clock() - ts)

    def _restarted(self, state: StreamState, before: int, now: int) -> None:
        """The publisher numbers its batches from the start again: a new engine, whose
        cache holds nothing of what the index has for it. Drop that, and follow the new
        stream as a new follower does (from its replay buffer, where it has batches
        before the next one)."""
        log.warning(
            "KV events from %s started over (batch %d after %d): a new engine; "
            "its entries are dropped and its stream followed anew",
            state.endpoint.endpoint,
            now,
            before,
        )
        state.restarts += 1
        self._resync(state)
        self._deliver(self._indexed_anew, state)
        state.next_batch, state._promised, state._last_live = None, 0, -1
        if state.on_restart is not None:
            self._deliver(state.on_restart)

    @staticmethod
    def _indexed_anew(state: StreamState) -> None:
        """On the event loop, after the old engine's batches: none of the new one's yet."""
        state.indexed_through = None

    def _resync(self, state: StreamState) -> None:
        """Forget what the replica held: its later events teach it again."""
        state.resyncs += 1
        self._deliver(state.on_events, [KVEvent(0, "cleared")])

    def _watch_silence(self, now: float) -> None:
        """A stream with a heartbeat (ours) that stops is stale. A foreign engine's is
        quiet whenever its cache is: the backend's health probe watches it instead."""
        for *_, state in self._streams.values():
            if not state.endpoint.load_endpoint:
                continue
            if not state.stale and now - state.last_heard > self._silence_s:
                log.warning("KV events from %s went silent", state.endpoint.endpoint)
                state.stale = True
                self._resync(state)
                state.load, state._load_bytes = None, b""  # its next report is news
                if state.on_load is not None:
                    self._deliver(state.on_load, None)

    def _learn(self, state: StreamState) -> None:
        """Replay what the publisher holds after the last batch seen (all of it, for a
        new follower)."""
        if state.endpoint.replay_endpoint:
            self._replay(state, state.next_batch or 0, ALL_LATER)

    def _replay(self, state: StreamState, start: int, until: int, timeout_s: float = 2.0) -> None:
        """Apply batches ``start`` .. ``until - 1`` from the replay socket, in order;
        where its buffer no longer holds one, drop the replica's entries and go on."""
        socket = self._context.socket(zmq.DEALER)
        socket.setsockopt(zmq.LINGER, 0)
        socket.connect(state.endpoint.replay_endpoint)
        try:
            socket.send_multipart((b"", start.to_bytes(8, "big")))
            while socket.poll(int(timeout_s * 1000)):
                *_, seq_bytes, payload = socket.recv_multipart()
                seq = int.from_bytes(seq_bytes, "big", signed=True)
                if seq == END_SEQ:
                    return
                expected = start if state.next_batch is None else state.next_batch
                if seq < expected or seq >= until:
                    continue
                if seq > expected:  # batches the buffer no longer holds
                    self._resync(state)
                self._apply(state, seq, payload, live=False)
                state.replayed += 1
        finally:
            socket.close(linger=0)
