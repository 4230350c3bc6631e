"""LoRA adapters on the simulated engine: identities salted by the adapter, GPU slots
(``max_loras``, LRU), the copy of an adapter priced in its step, and vLLM's wire."""

from __future__ import annotations

import httpx
import pytest

from replica.api.cost_model import get_profile
from replica.api.identity import block_hashes, identity_seed
from replica.api.kv_events import KVEvent
from replica.api.kv_wire import decode_batch, encode_batch
from replica.engine import Engine, EngineConfig
from replica.lora import AdapterSlots, UnknownAdapter
from replica.sequence import EngineRequest
from tests.replica.test_engine import run
from tests.shared import prompt, replica_stats


def request(
    name: str, lora: str | None, length: int = 512, max_tokens: int = 4, start: int = 1
) -> EngineRequest:
    return EngineRequest(name, prompt(length, start), max_tokens, ignore_eos=True, lora=lora)


def engine(**config) -> Engine:
    return Engine(EngineConfig(num_blocks=1024, lora_modules=("sql", "chat"), **config))


def test_the_same_prompt_under_two_adapters_shares_no_block():
    replica = engine(max_loras=2)
    run(replica, [request("base", None)])
    under_sql = run(replica, [request("sql-1", "sql")])["sql-1"]
    again_sql = run(replica, [request("sql-2", "sql")])["sql-2"]
    under_chat = run(replica, [request("chat-1", "chat")])["chat-1"]
    assert under_sql["cached"] == 0 and under_chat["cached"] == 0
    assert again_sql["cached"] == 496  # all but the last block, as under the base model
    # the engine's identities are the adapter-seeded ones a router computes
    assert replica.cache.lookup(block_hashes(prompt(512), 16, identity_seed("sql"))[0])


def test_a_request_whose_adapter_has_no_slot_is_passed_over_not_blocking_others():
    replica = engine(max_loras=1)
    for name, lora in (("sql-long", "sql"), ("chat", "chat"), ("base", None)):
        replica.add_request(request(name, lora, max_tokens=50 if name == "sql-long" else 2))
    first = replica.step()
    admitted = {out.request_id for out in first.outputs}
    # the adapter request behind the busy slot waits; the base model's goes ahead of it
    assert admitted == {"sql-long", "base"} and replica.num_waiting == 1
    assert replica.scheduler.waiting[0].request_id == "chat"
    while replica.has_unfinished:
        replica.step()
    assert replica.adapters.resident == ("chat",) and replica.adapters.loads == 2


def test_copying_an_adapter_into_a_slot_costs_its_step_the_link_time():
    cold, warm = engine(max_loras=1), engine(max_loras=1)
    run(warm, [request("before", "sql", 64, max_tokens=1, start=5000)])  # sql holds the slot
    for replica in (cold, warm):  # the same prompt, not cached on either
        replica.add_request(request("a", "sql", length=300, max_tokens=1))
    load = get_profile(cold.config.profile).adapter_load_time()
    assert load > 0.001  # 84 MB over PCIe 5: 1.7 ms
    assert cold.step().duration_s == pytest.approx(warm.step().duration_s + load)


def test_an_unknown_adapter_is_refused_and_slots_follow_lru():
    with pytest.raises(UnknownAdapter, match="'nope' is not loaded"):
        engine().add_request(request("x", "nope"))
    slots = AdapterSlots(2, ["a", "b", "c"])
    for name in ("a", "b"):
        slots.use(name)
        slots.done(name)
    slots.use("a")  # a is now the most recently used
    slots.done("a")
    slots.use("c")  # evicts b, the least recently used
    assert slots.resident == ("a", "c") and slots.take_loads() == 3
    assert not slots.unregister("c")  # in use
    slots.done("c")
    assert slots.unregister("c") and slots.resident == ("a",)


def test_adapter_and_salt_travel_in_vllms_fields_and_back():
    stored = KVEvent(1, "stored", (11, 12), None, (), "GPU", prompt(32).tobytes(), "t1", "sql")
    child = KVEvent(2, "stored", (13,), 12, (), "GPU", prompt(16).tobytes(), None, "sql")
    plain = KVEvent(3, "stored", (14,), None, (), "GPU", prompt(16).tobytes(), "t2")
    _, events, _ = decode_batch(encode_batch([stored, child, plain], 0.0, 16))
    assert [(e.salt, e.lora) for e in events] == [("t1", "sql"), (None, "sql"), ("t2", None)]


@pytest.mark.slow
def test_a_replica_serves_adapters_as_vllm_does():
    from deploy.processes import running

    with running(["replica", "--speedup", "20", "--lora-modules", "sql", "--max-loras", "2"]) as (
        url,
    ):
        listed = httpx.get(f"{url}/v1/models").json()["data"]
        assert [(m["id"], m["parent"]) for m in listed] == [
            ("sim-llama3-8b", None),
            ("sql", "sim-llama3-8b"),
        ]
        body = {"prompt": "SELECT " * 200, "max_tokens": 2, "model": "sql"}
        first = httpx.post(f"{url}/v1/completions", json=body).json()
        again = httpx.post(f"{url}/v1/completions", json=body).json()
        base = httpx.post(f"{url}/v1/completions", json={**body, "model": None}).json()
        assert first["model"] == "sql" and again["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert base["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # not the adapter's
        unknown = httpx.post(f"{url}/v1/completions", json={**body, "model": "geo"})
        assert unknown.status_code == 404 and "'geo' does not exist" in unknown.text
        loaded = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "geo"})
        twice = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "geo"})
        assert loaded.status_code == 200 and twice.status_code == 400
        assert httpx.post(f"{url}/v1/completions", json={**body, "model": "geo"}).status_code == 200
        stats = replica_stats(url)
        assert stats.adapters == ("geo", "sql") and stats.adapter_loads == 2
        assert set(stats.resident_adapters) == {"geo", "sql"}
        gone = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "geo"})
        missing = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "geo"})
        assert gone.status_code == 200 and missing.status_code == 404
