"""KV events pushed on ZMQ in vLLM's wire format: every encoding decodes, gaps are
replayed, a late subscriber catches up, a silent stream goes stale."""

import asyncio
import contextlib
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import httpx
import msgspec
import numpy as np
import pytest
import uvicorn
import zmq

from deploy.processes import free_port, running
from replica.api.config import ReplicaConfig
from replica.api.identity import DEFAULT_MODEL, identity_seed, prefix_keys
from replica.api.kv_events import KVEvent, decode_page
from replica.api.kv_wire import decode_batch, encode_batch
from replica.api.stats import KVEventsEndpoint, LoadReport
from replica.event_log import EventLog
from replica.kv_publisher import KVPublisher
from replica.server import create_app
from replica.service import Replica
from router.index.kv_subscriber import KVStreams, StreamState
from router.index.prefix_index import IndexConfig, PrefixIndex
from tests.shared import (
    FakeClock,
    gateway_stats,
    logged_gateway,
    replica_stats,
    settled,
    wait_for,
    wait_until_indexed,
)

# ----------------------------------------------------------------- every encoding


def vllm_classes(batch_as_array: bool, events_as_arrays: bool) -> dict[str, Any]:
    """vLLM's event classes, written here independently, in one of the encodings its
    releases used: positional arrays throughout (the oldest), tagged maps in an array
    batch, tagged maps in a map batch (the newest)."""

    class EventBatch(msgspec.Struct, array_like=batch_as_array, omit_defaults=True):
        ts: float
        events: list[Any]
        data_parallel_rank: int | None = None

    class KVCacheEvent(msgspec.Struct, array_like=events_as_arrays, omit_defaults=True, tag=True):
        pass

    class BlockStored(KVCacheEvent):
        block_hashes: list[int | bytes]
        parent_block_hash: int | bytes | None
        token_ids: list[int]
        block_size: int
        lora_id: int | None
        medium: str | None = None
        lora_name: str | None = None
        extra_keys: list[Any] | None = None

    class BlockRemoved(KVCacheEvent):
        block_hashes: list[int | bytes]
        medium: str | None = None

    class AllBlocksCleared(KVCacheEvent):
        pass

    return locals()


@pytest.mark.parametrize(
    ("batch_as_array", "events_as_arrays"),
    [(True, True), (True, False), (False, False)],
    ids=["arrays", "maps-in-array", "maps"],
)
def test_every_vllm_encoding_decodes(batch_as_array, events_as_arrays):
    vllm = vllm_classes(batch_as_array, events_as_arrays)
    tokens = list(range(1, 33))
    sha = [bytes([i]) * 32 for i in range(2)]
    batch = vllm["EventBatch"](
        1234.5,
        [
            vllm["BlockStored"](sha, None, tokens, 16, None, "GPU", None, [["acme"], None]),
            vllm["BlockStored"]([9], 7, tokens[:16], 16, None, "CPU"),
            vllm["BlockRemoved"]([sha[1]], "GPU"),
            vllm["AllBlocksCleared"](),
        ],
        0,
    )
    ts, events, block_size = decode_batch(msgspec.msgpack.encode(batch))
    assert ts == 1234.5 and block_size == 16
    first, demoted, removed, cleared = events
    assert first.kind == "stored" and first.parent_hash is None and first.salt == "acme"
    assert first.block_hashes == tuple(int.from_bytes(h, "big") for h in sha)
    assert np.frombuffer(first.token_bytes, dtype="<u4").tolist() == tokens
    assert (demoted.medium, demoted.parent_hash, demoted.block_hashes) == ("CPU", 7, (9,))
    assert removed.kind == "removed" and removed.block_hashes == (first.block_hashes[1],)
    assert cleared.kind == "cleared"


def test_our_encoder_writes_what_vllms_newest_classes_read():
    tokens = np.arange(1, 33, dtype="<u4").tobytes()
    ours = [
        KVEvent(1, "stored", (5, 6), None, (0, 1), "GPU", tokens, "acme"),
        KVEvent(2, "removed", (6,), medium="CPU"),
        KVEvent(3, "cleared"),
    ]
    vllm = vllm_classes(False, False)
    decoder = msgspec.msgpack.Decoder(vllm["EventBatch"])
    batch = decoder.decode(encode_batch(ours, 99.0, 16))
    stored = msgspec.convert(batch.events[0], vllm["BlockStored"])
    assert stored.block_hashes == [5, 6] and stored.token_ids == list(range(1, 33))
    assert stored.extra_keys == [["acme"], None] and stored.block_size == 16
    assert [e["type"] for e in batch.events] == ["BlockStored", "BlockRemoved", "AllBlocksCleared"]
    assert decode_batch(encode_batch(ours, 99.0, 16))[1][0].salt == "acme"


def test_garbage_is_refused_not_applied():
    for payload in (
        b"\xc1",
        msgspec.msgpack.encode({"ts": 1.0}),
        msgspec.msgpack.encode([1.0, [["Nope"]]]),
    ):
        with pytest.raises(ValueError):
            decode_batch(payload)


# ----------------------------------------------------------------- a publisher's stream


def test_a_stream_applied_again_from_a_batch_gets_every_batch_from_there():
    """``replay_since``: the batches from the one given, in order, from the replay socket;
    from a batch the buffer no longer holds, the replica's entries start over (a resync)
    and what the buffer holds is applied."""
    log = EventLog()
    publisher = KVPublisher(log, 16, lambda: LoadReport(0, 0, 0), buffer_batches=4)
    endpoint = publisher.start()
    applied: list[object] = []  # each batch's one removed block, or "cleared"
    streams = KVStreams(lambda fn, *args: fn(*args))  # the test reads lists only

    def publish(blocks: range) -> None:
        for block in blocks:
            log.append("removed", (block,))
            publisher.flush()

    def record(events: list[KVEvent]) -> None:
        applied.extend(e.kind if e.kind == "cleared" else e.block_hashes[0] for e in events)

    try:
        state = streams.follow("r", endpoint, record)
        wait_for(lambda: state.load is not None, what="the stream connected")
        publish(range(4))
        wait_for(lambda: state.indexed_through == 4, what="the four batches")
        assert applied == [0, 1, 2, 3] and state.resyncs == 0
        replayed = state.replayed
        streams.replay_since("r", 2)
        wait_for(lambda: len(applied) == 6, what="batches 2 and 3 again")
        assert applied[4:] == [2, 3] and state.replayed == replayed + 2
        assert state.indexed_through == 4 and state.next_batch == 4 and state.resyncs == 0

        publish(range(4, 8))  # the buffer keeps batches 4 to 7 only
        wait_for(lambda: state.indexed_through == 8, what="four more")
        del applied[:]
        streams.replay_since("r", 1)
        wait_for(lambda: len(applied) == 5, what="a resync and the buffer")
        assert applied == ["cleared", 4, 5, 6, 7] and state.resyncs == 1
        assert state.next_batch == 8
    finally:
        streams.close()
        publisher.stop()


@pytest.mark.parametrize("heartbeat", [True, False], ids=["ours", "vllm-like"])
def test_an_engine_restarted_on_the_same_sockets_is_followed_anew(heartbeat):
    """A new engine where the last one published (vLLM's fixed ports) numbers its
    batches from 0 again: its old entries are dropped at once, its batches applied
    (not taken for replays), and the restart counted. With our heartbeat the count in
    its load report gives it away before any batch; without (vLLM's), its first batch."""
    applied: list[object] = []  # each batch's one removed block, or "cleared"
    streams = KVStreams(lambda fn, *args: fn(*args))

    def record(events: list[KVEvent]) -> None:
        applied.extend(e.kind if e.kind == "cleared" else e.block_hashes[0] for e in events)

    def engine(running: int, at: KVEventsEndpoint | None = None) -> tuple[EventLog, KVPublisher]:
        log = EventLog()  # running: told apart in the load reports
        publisher = KVPublisher(log, 16, lambda: LoadReport(running, 0, 0))
        publisher.start(at)
        return log, publisher

    def publish(log: EventLog, publisher: KVPublisher, blocks: range) -> None:
        for block in blocks:
            log.append("removed", (block,))
            publisher.flush()

    log, first = engine(running=1)
    assert first.endpoint is not None
    endpoint = first.endpoint if heartbeat else replace(first.endpoint, load_endpoint="")
    try:
        state = streams.follow("r", endpoint, record)
        wait_for(lambda: state.learned, what="the stream followed")
        time.sleep(0.3)  # the subscription reaches the publisher (ZMQ's slow joiner)
        publish(log, first, range(5))
        wait_for(lambda: state.indexed_through == 5, what="the first engine's batches")
        first.stop()
        log, second = engine(running=2, at=first.endpoint)
        try:
            if heartbeat:  # its first report says it has published nothing
                wait_for(lambda: state.restarts == 1, what="the restart, from the load report")
                assert applied[-1] == "cleared" and state.next_batch is None
            else:
                time.sleep(0.5)  # the subscriber reconnects to the new publisher
            publish(log, second, range(100, 103))
            wait_for(lambda: state.indexed_through == 3, what="the new engine's batches")
            assert applied == [0, 1, 2, 3, 4, "cleared", 100, 101, 102]
            assert state.restarts == 1 and state.next_batch == 3
        finally:
            second.stop()
    finally:
        streams.close()


# ----------------------------------------------------------------- a real replica's stream

REPLICA = ["replica", "--speedup", "50", "--num-blocks", "256", "--host-blocks", "64"]


def keys(tokens: np.ndarray) -> list[int]:
    return prefix_keys(tokens, 16, 4, identity_seed(DEFAULT_MODEL))


def index() -> PrefixIndex:
    made = PrefixIndex(IndexConfig(mode="precise", recent_s=0.0), 16, FakeClock())
    made.add_replica("r", 256)
    return made


def complete(url: str, i: int) -> None:
    prompt = [i * 1000 + t for t in range(1, 400)]  # 24 full blocks each, 6 router keys
    httpx.post(url + "/v1/completions", json={"prompt": prompt, "max_tokens": 2}, timeout=30)


def held(idx: PrefixIndex) -> tuple[set[int], set[int]]:
    assert idx.stored is not None and idx.host is not None
    return set(idx.stored.held(0)), set(idx.host.held(0))


def truth(url: str) -> tuple[set[int], set[int]]:
    """The replica's whole event history, applied to a fresh index."""
    fresh = index()
    fresh.apply_events("r", decode_page(httpx.get(url + "/kv_events").content).events)
    return held(fresh)


class Follower:
    """A :class:`KVStreams` whose events go into one index, under a lock (the test
    reads the index from its own thread)."""

    def __init__(self, silence_s: float = 1.0) -> None:
        self.index, self.lock = index(), threading.Lock()
        self.streams = KVStreams(self._deliver, silence_s=silence_s)

    def _deliver(self, fn: Any, *args: Any) -> None:
        with self.lock:
            fn(*args)

    def follow(self, endpoint: Any, next_batch: int | None = None) -> StreamState:
        return self.streams.follow(
            "r", endpoint, lambda e: self.index.apply_events("r", e), next_batch=next_batch
        )

    def held(self) -> tuple[set[int], set[int]]:
        with self.lock:
            return held(self.index)


@pytest.fixture
def follower():
    made = Follower()
    yield made
    made.streams.close()


@pytest.mark.slow
def test_a_follower_cut_off_mid_stream_replays_the_gap_and_loses_nothing(follower):
    with running(REPLICA) as (url,):
        endpoint = replica_stats(url).kv_events
        assert endpoint is not None and endpoint.endpoint.startswith("tcp://127.0.0.1:")
        assert endpoint.load_endpoint.startswith("tcp://127.0.0.1:")
        before = follower.follow(endpoint)
        wait_for(lambda: before.load is not None, what="the stream connected")  # heartbeats
        for i in range(4):
            complete(url, i)
        wait_for(lambda: follower.held() == truth(url), what="the first events")
        follower.streams.forget("r")  # the connection dies mid-stream
        for i in range(4, 12):  # published while nobody listened: evictions to the host too
            complete(url, i)
        after = follower.follow(endpoint, next_batch=before.next_batch)
        # Nothing new is published: the heartbeat reveals the gap.
        wait_for(lambda: after.gaps == 1 and after.replayed > 0, what="the gap replayed")
        assert after.gaps == 1 and after.replayed > 0 and after.resyncs == 0
        complete(url, 12)

        def caught_up() -> bool:  # the index, and the load reports, past the last batch
            load = after.load
            return (
                follower.held() == truth(url)
                and load is not None
                and (load.batches == after.next_batch)
            )

        wait_for(caught_up, what="the index and the load reports caught up")
        gpu, host = follower.held()
        assert (gpu, host) == truth(url)  # no entry lost, none stale
        assert set(keys(np.arange(12001, 12400))[:6]) <= gpu
        assert host  # the host tier's events came through the replay too
        assert after.load is not None and after.load.batches == after.next_batch
        assert after.load.free_blocks == 256  # idle: every block free or reclaimable


@pytest.mark.slow
def test_a_gateway_that_starts_late_learns_the_cache_from_the_replay_buffer():
    with running(REPLICA) as (url,):
        for i in range(3):
            complete(url, i)
        # Unchecked: the check's canary would add a live batch to the replayed ones.
        with running(["gateway", f"--backend={url}", "--no-check-backends"]) as (gateway,):
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                stream = gateway_stats(gateway).backends[0].kv_stream
                if stream is not None and stream.batches > 0:
                    break
                time.sleep(0.1)
            assert stream is not None and stream.latency_p50_s is None  # replayed: not timed
            prompt = [2000 + t for t in range(1, 400)]
            answer = httpx.post(
                gateway + "/v1/completions", json={"prompt": prompt, "max_tokens": 2}
            )
            predicted = int(answer.headers["x-prefix-router-predicted-cached-tokens"])
            cached = answer.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
            assert predicted == 384 and cached == 384  # known from before the gateway existed

            # Then the stream goes on live, and live batches are timed (a batch that
            # came while the replay was still being read may count among the replayed).
            later = [3000 + t for t in range(1, 100)]
            httpx.post(gateway + "/v1/completions", json={"prompt": later, "max_tokens": 2})

            def timed() -> bool:
                stream = gateway_stats(gateway).backends[0].kv_stream
                return stream is not None and stream.latency_p99_s is not None

            wait_for(timed, what="a live batch timed")
            stream = gateway_stats(gateway).backends[0].kv_stream
            assert stream is not None and stream.replayed > 0


@pytest.mark.slow
def test_a_silent_stream_goes_stale_and_its_entries_are_dropped():
    follower = Follower(silence_s=0.3)
    try:
        with running(REPLICA) as (url,):
            endpoint = replica_stats(url).kv_events
            assert endpoint is not None
            complete(url, 0)
            state = follower.follow(endpoint)
            wait_for(lambda: len(follower.held()[0]) == 6, what="the replayed blocks")
            assert not state.stale
        wait_for(lambda: state.stale, what="the silent stream gone stale")  # replica gone
        assert state.stale and follower.held() == (set(), set())
    finally:
        follower.streams.close()


@pytest.mark.slow
def test_a_vllm_server_named_per_backend_is_routed_precisely_and_never_goes_stale():
    """A foreign engine: its KV events come from a publisher the gateway is told about
    (``--backend URL,kv=...,topic=...``), with vLLM's newest encoding and sha256-sized
    hashes, no heartbeat and no replay socket."""
    vllm = vllm_classes(False, False)
    prompt = np.arange(1, 513, dtype="<u4")  # 32 blocks of 16 tokens
    hashes = [bytes([i]) * 32 for i in range(32)]
    stored = vllm["BlockStored"](hashes, None, prompt.tolist(), 16, None, "GPU")
    context = zmq.Context()
    publisher = context.socket(zmq.PUB)
    port = publisher.bind_to_random_port("tcp://127.0.0.1")
    encoder = msgspec.msgpack.Encoder()
    try:
        with running(["replica"], ["replica"]) as (foreign, other):
            spec = f"{foreign},kv=tcp://127.0.0.1:{port},topic=kv-events"
            gateway_command = [
                "gateway",
                f"--backend={spec}",
                f"--backend={other}",
                "--no-check-backends",
            ]  # its events are faked: never checked
            with running(gateway_command) as (gateway,):
                seq = 0
                while not any(
                    b.kv_stream and b.kv_stream.batches for b in gateway_stats(gateway).backends
                ):
                    batch = vllm["EventBatch"](time.time(), [stored])
                    publisher.send_multipart(
                        [b"kv-events", seq.to_bytes(8, "big"), encoder.encode(batch)]
                    )
                    seq += 1
                    time.sleep(0.05)
                time.sleep(1.5)  # a duration under test: longer than a stale heartbeat
                body = {"prompt": [*prompt.tolist(), 7, 8, 9], "max_tokens": 1}
                for _ in range(3):
                    answer = httpx.post(gateway + "/v1/completions", json=body, timeout=30)
                    assert answer.headers["x-prefix-router-replica"] == foreign
                    assert int(answer.headers["x-prefix-router-predicted-cached-tokens"]) == 512
                streams = {b.url: b.kv_stream for b in gateway_stats(gateway).backends}
                assert not streams[foreign].stale and streams[foreign].endpoint.endswith(str(port))
    finally:
        publisher.close(linger=0)
        context.term()


@pytest.mark.slow
def test_a_vllm_engine_restarted_behind_the_same_sockets_is_forgotten_at_its_first_batch():
    """vLLM's ports are fixed: a restarted server's publisher numbers its batches from 0
    again on the same socket. Its first batch tells the gateway: the old engine's
    entries go at once (no over-prediction of what it held), the new one's are learned."""
    vllm = vllm_classes(False, False)
    old_prompt = np.arange(1, 513, dtype="<u4")  # 32 blocks of 16 tokens
    new_prompt = np.arange(1001, 1513, dtype="<u4")

    def stored(prompt: np.ndarray, tag: int) -> Any:
        hashes = [bytes([tag, i]) * 16 for i in range(32)]
        return vllm["BlockStored"](hashes, None, prompt.tolist(), 16, None, "GPU")

    context = zmq.Context()
    publisher = context.socket(zmq.PUB)
    port = publisher.bind_to_random_port("tcp://127.0.0.1")
    encoder = msgspec.msgpack.Encoder()

    def publish(seq: int, event: Any) -> None:
        batch = vllm["EventBatch"](time.time(), [event])
        publisher.send_multipart([b"kv-events", seq.to_bytes(8, "big"), encoder.encode(batch)])

    def predicted(gateway: str, prompt: np.ndarray) -> int:
        body = {"prompt": [*prompt.tolist(), 7, 8, 9], "max_tokens": 1}
        answer = httpx.post(gateway + "/v1/completions", json=body, timeout=30)
        return int(answer.headers["x-prefix-router-predicted-cached-tokens"])

    def stream(gateway: str) -> Any:
        return gateway_stats(gateway).backends[0].kv_stream

    try:
        with running(["replica"]) as (engine,):
            spec = f"{engine},kv=tcp://127.0.0.1:{port},topic=kv-events"
            with running(["gateway", f"--backend={spec}", "--no-check-backends"]) as (gateway,):
                seq = 0
                while not stream(gateway).batches:  # until the subscription is up
                    publish(seq, stored(old_prompt, 1))
                    seq += 1
                    time.sleep(0.05)
                publish(seq, stored(old_prompt, 1))  # the old engine's last batches
                wait_for(lambda: stream(gateway).indexed_through == seq + 1, what="old batches")
                assert predicted(gateway, old_prompt) == 512
                publish(0, stored(new_prompt, 2))  # the new engine's first batch
                wait_for(lambda: stream(gateway).restarts == 1, what="the restart seen")
                wait_for(lambda: stream(gateway).indexed_through == 1, what="its batch indexed")
                assert predicted(gateway, old_prompt) == 0
                assert predicted(gateway, new_prompt) == 512
    finally:
        publisher.close(linger=0)
        context.term()


@pytest.mark.slow
def test_a_vllm_server_that_dies_is_found_by_its_health_probe_not_by_its_quiet_stream():
    """A foreign stream has no heartbeat, so its quiet says nothing: its /health does."""
    context = zmq.Context()
    publisher = context.socket(zmq.PUB)
    port = publisher.bind_to_random_port("tcp://127.0.0.1")
    try:
        with running(["replica"]) as (alive,):
            dead = f"http://127.0.0.1:{free_port()}"  # nothing answers there
            spec = f"{dead},kv=tcp://127.0.0.1:{port}"
            with running(["gateway", f"--backend={spec}", f"--backend={alive}"]) as (gateway,):
                deadline = time.monotonic() + 10
                while True:
                    health = {b.url: b.healthy for b in gateway_stats(gateway).backends}
                    if not health[dead]:
                        break
                    assert time.monotonic() < deadline, "the dead backend still looks healthy"
                    time.sleep(0.1)
                assert health[alive]
    finally:
        publisher.close(linger=0)
        context.term()


@pytest.mark.slow
def test_a_reset_reaches_the_followers_without_waiting_for_a_step(follower):
    """An idle replica that is reset pushes its ``cleared`` at once: before, it went
    out with the next engine step, and until then every gateway predicted hits there."""
    with running(REPLICA) as (url,):
        endpoint = replica_stats(url).kv_events
        assert endpoint is not None
        complete(url, 0)
        follower.follow(endpoint)
        wait_for(lambda: len(follower.held()[0]) == 6, what="the stored blocks")
        assert httpx.post(url + "/reset").status_code == 200
        wait_for(lambda: follower.held() == (set(), set()), what="the reset at the follower")


# ----------------------------------------------------------------- an engine that evicts silently


@contextlib.contextmanager
def replica_in_this_process(
    config: ReplicaConfig,
) -> Iterator[tuple[str, Replica, asyncio.AbstractEventLoop]]:
    """A simulated replica served from a thread of this process, so that a test can reach
    its engine and its publisher (on its event loop, the one returned): its URL."""
    app, port = create_app(config), free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_until_complete, args=(server.serve(),))
    thread.start()
    try:
        wait_for(lambda: server.started or not thread.is_alive(), what="the replica serving")
        assert server.started, "the replica did not start"
        yield f"http://127.0.0.1:{port}", app.state.replica, loop
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        loop.close()


def evict_without_telling(replica: Replica, loop: asyncio.AbstractEventLoop) -> None:
    """The engine empties its cache and the batch that says so is never published."""

    async def evict() -> None:
        assert replica.engine.reset_cache()
        assert replica.publisher is not None
        replica.publisher.withhold_for_tests()

    asyncio.run_coroutine_threadsafe(evict(), loop).result(timeout=10)


def ask(gateway: str, i: int) -> tuple[int, int]:
    """The gateway's prediction of a prompt's cached tokens, and the engine's figure."""
    prompt = [i * 1000 + t for t in range(1, 400)]  # 24 full blocks, 6 router keys
    body = {"prompt": prompt, "max_tokens": 2}
    answer = httpx.post(gateway + "/v1/completions", json=body, timeout=30)
    assert answer.status_code == 200, answer.text
    predicted = int(answer.headers["x-prefix-router-predicted-cached-tokens"])
    return predicted, answer.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


@pytest.mark.slow
def test_an_engine_that_evicts_without_telling_is_found_out_and_its_stream_applied_again(
    tmp_path,
):
    """Events said the replica held two prompts; its engine let them go and the batch
    that said so was withheld. The first answer below the events' figure is a
    disagreement: the prompt's entries are dropped, the stream applied again from that
    request's dispatch, and the next prediction is exact (the request's own blocks came
    back from the replay). Counted apart, logged once."""
    log = tmp_path / "gateway.log"
    config = ReplicaConfig(speedup=50.0, num_blocks=256, host_blocks=0)
    with (
        replica_in_this_process(config) as (url, replica, loop),
        logged_gateway(log, f"--backend={url}") as gateway,
    ):
        settled(gateway, [url])
        for i in (1, 2):
            ask(gateway, i)
        wait_until_indexed(gateway)
        assert ask(gateway, 1) == (384, 384)
        evict_without_telling(replica, loop)
        before = gateway_stats(gateway).backends[0]
        assert before.kv_stream is not None and before.kv_stream.indexed_through is not None
        dispatched_at = before.kv_stream.indexed_through
        assert ask(gateway, 1) == (384, 0)  # over: the engine let it go without a word

        def replayed() -> bool:  # every batch since the dispatch, applied again
            backend = gateway_stats(gateway).backends[0]
            published = replica_stats(url).kv_event_batches
            stream = backend.kv_stream
            assert stream is not None and before.kv_stream is not None
            again = stream.replayed - before.kv_stream.replayed
            return backend.event_disagreements == 1 and again >= published - dispatched_at

        wait_for(replayed, what="the disagreement found and the stream applied again")
        wait_until_indexed(gateway)
        assert ask(gateway, 1) == (384, 384)  # exact again: its own blocks replayed
        assert ask(gateway, 2) == (384, 0)  # the other prompt: found out the same way
        stats = gateway_stats(gateway).backends[0]
        assert (stats.event_disagreements, stats.decision_corrections) == (2, 0)
        assert stats.kv_stream is not None and stats.kv_stream.resyncs == 0
        metrics = httpx.get(f"{gateway}/metrics").text
        assert (
            f'prefix_router_index_corrections_total{{replica="{url}",source="events"}} 2.0'
            in metrics
        )
    lines = [line for line in log.read_text().splitlines() if "no eviction told" in line]
    assert len(lines) == 1  # once per replica, not per answer
