"""KV events pushed on ZMQ in vLLM's wire format: every encoding decodes, gaps are
replayed, a late subscriber catches up, a silent stream goes stale."""

import asyncio
import time
from typing import Any

import httpx
import msgspec
import numpy as np
import pytest
import zmq.asyncio

from deploy.processes import running
from replica.api.identity import DEFAULT_MODEL, identity_seed, prefix_keys
from replica.api.kv_events import KVEvent, decode_page
from replica.api.kv_wire import decode_batch, encode_batch
from router.kv_subscriber import KVSubscriber
from router.prefix_index import IndexConfig, PrefixIndex
from tests.shared import FakeClock, gateway_stats, replica_stats

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
    ours = [KVEvent(1, "stored", (5, 6), None, (0, 1), "GPU", tokens, "acme"),
            KVEvent(2, "removed", (6,), medium="CPU"), KVEvent(3, "cleared")]  # fmt: skip
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


# ----------------------------------------------------------------- a real replica's stream

REPLICA = ["replica", "--speedup", "50", "--num-blocks", "256", "--host-blocks", "64"]


def keys(tokens: np.ndarray) -> list[int]:
    return prefix_keys(tokens, 64, identity_seed(DEFAULT_MODEL))


def index() -> PrefixIndex:
    made = PrefixIndex(IndexConfig(mode="precise", recent_s=0.0), 16, FakeClock())
    made.add_replica("r", 256)
    return made


def complete(url: str, i: int) -> None:
    prompt = [i * 1000 + t for t in range(1, 400)]  # 24 full blocks each, 6 router keys
    httpx.post(url + "/v1/completions", json={"prompt": prompt, "max_tokens": 2}, timeout=30)


def held(idx: PrefixIndex) -> tuple[set[int], set[int]]:
    bit = 1
    gpu = {k for k, mask in idx.stored.holders.items() if mask & bit}  # type: ignore[union-attr]
    host = {k for k, mask in idx.host.holders.items() if mask & bit}  # type: ignore[union-attr]
    return gpu, host


def truth(url: str) -> tuple[set[int], set[int]]:
    """The replica's whole event history, applied to a fresh index."""
    fresh = index()
    fresh.apply_events("r", decode_page(httpx.get(url + "/kv_events").content).events)
    return held(fresh)


async def follow(subscriber: KVSubscriber, seconds: float) -> None:
    task = asyncio.get_running_loop().create_task(subscriber.run())
    await asyncio.sleep(seconds)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


@pytest.mark.slow
def test_a_subscriber_cut_off_mid_stream_replays_the_gap_and_loses_nothing():
    with running(REPLICA) as (url,):
        endpoint = replica_stats(url).kv_events
        assert endpoint is not None and endpoint.endpoint.startswith("tcp://127.0.0.1:")
        idx = index()

        async def scenario() -> KVSubscriber:
            context = zmq.asyncio.Context()
            subscriber = KVSubscriber(
                endpoint, lambda e: idx.apply_events("r", e), lambda _: None, context
            )
            runner = asyncio.get_running_loop().create_task(subscriber.run())
            await asyncio.sleep(0.3)  # connected
            for i in range(4):
                await asyncio.to_thread(complete, url, i)
            await asyncio.sleep(0.2)
            runner.cancel()  # the connection dies mid-stream
            await asyncio.gather(runner, return_exceptions=True)
            for i in range(4, 12):  # published while nobody listened: evictions to the host too
                await asyncio.to_thread(complete, url, i)
            await follow(subscriber, 0.3)  # back: nothing new yet
            await asyncio.to_thread(complete, url, 12)  # the next batch reveals the gap
            await follow(subscriber, 1.0)
            context.term()
            return subscriber

        subscriber = asyncio.run(scenario())
        state = subscriber.state
        assert state.gaps >= 1 and state.replayed > 0 and state.resyncs == 0
        gpu, host = held(idx)
        assert (gpu, host) == truth(url)  # no entry lost, none stale
        assert set(keys(np.arange(12001, 12400))[:6]) <= gpu
        assert host  # the host tier's events came through the replay too


@pytest.mark.slow
def test_a_gateway_that_starts_late_learns_the_cache_from_the_replay_buffer():
    with running(REPLICA) as (url,):
        for i in range(3):
            complete(url, i)
        with running(["gateway", f"--backend={url}"]) as (gateway,):
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                stream = gateway_stats(gateway).backends[0].kv_stream
                if stream is not None and stream.batches > 0:
                    break
                time.sleep(0.1)
            prompt = [2000 + t for t in range(1, 400)]
            answer = httpx.post(
                gateway + "/v1/completions", json={"prompt": prompt, "max_tokens": 2}
            )
            predicted = int(answer.headers["x-prefix-router-predicted-cached-tokens"])
            cached = answer.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
            assert predicted == 384 and cached == 384  # known from before the gateway existed
            stream = gateway_stats(gateway).backends[0].kv_stream
            assert stream is not None and stream.replayed > 0 and stream.latency_p99_s is not None


@pytest.mark.slow
def test_a_silent_stream_goes_stale_and_its_entries_are_dropped():
    idx = index()
    with running(REPLICA) as (url,):
        endpoint = replica_stats(url).kv_events
        assert endpoint is not None
        complete(url, 0)

        async def listen() -> Any:
            context = zmq.asyncio.Context()
            subscriber = KVSubscriber(
                endpoint, lambda e: idx.apply_events("r", e), lambda _: None, context, silence_s=0.3
            )
            task = asyncio.get_running_loop().create_task(subscriber.run())
            await asyncio.sleep(0.5)
            return subscriber, task, context

        async def scenario() -> Any:
            subscriber, task, context = await listen()
            learned = len(held(idx)[0])
            assert learned == 6 and not subscriber.state.stale
            return subscriber, task, context, learned

        loop = asyncio.new_event_loop()
        subscriber, task, context, _ = loop.run_until_complete(scenario())
    # The replica is gone: its stream falls silent.
    loop.run_until_complete(asyncio.sleep(0.8))
    assert subscriber.state.stale and held(idx) == (set(), set())
    task.cancel()
    loop.run_until_complete(asyncio.gather(task, return_exceptions=True))
    context.term()
    loop.close()
