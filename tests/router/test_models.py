"""A fleet of several models and LoRA adapters behind one gateway (real processes)."""

from __future__ import annotations

import shlex
import time

import httpx
import numpy as np
import pytest

from deploy.processes import running
from replica.api.identity import identity_seed, prefix_keys
from replica.api.kv_events import KVEvent
from router.core import ReplicaState, RoutingRequest
from router.fleet.models import ModelRoutes, ServedName
from router.index.event_keys import EventKeys
from router.policies import make_policy
from tests.shared import gateway_stats, prompt, wait_for

SYSTEM = "You answer questions about the fleet. " * 40


def post(url: str, model: str | None, text: str) -> httpx.Response:
    body = {"prompt": SYSTEM + text, "max_tokens": 2}
    if model is not None:
        body["model"] = model
    return httpx.post(f"{url}/v1/completions", json=body, timeout=30)


@pytest.mark.slow
def test_each_request_goes_to_a_replica_of_its_model_or_adapter():
    llama = shlex.split("replica --speedup 20 --model llama --lora-modules sql --max-loras 2")
    qwen = ["replica", "--speedup", "20", "--model", "qwen"]
    with running(llama, llama, qwen) as replicas:
        served = {"llama": set(replicas[:2]), "sql": set(replicas[:2]), "qwen": {replicas[2]}}
        backends = [f"--backend={url}" for url in replicas]
        gateway = ["gateway", *backends, "--model", "llama", "--describe-interval-s", "0.5"]
        with running(gateway) as (url,):

            def models() -> list[tuple[str, str | None]]:
                listed = httpx.get(f"{url}/v1/models").json()["data"]
                return [(m["id"], m["parent"]) for m in listed]

            # the gateway answers once up; a replica it has not checked yet is not listed
            # (seen once in CI: qwen's, on a busy machine)
            wait_for(lambda: len(models()) == 3, 30, "every replica's models listed")
            assert models() == [("llama", None), ("qwen", None), ("sql", "llama")]
            urls = {b.replica_id: b.url for b in gateway_stats(url).backends}
            for turn in range(6):
                for model in ("llama", "qwen", "sql", None):
                    answer = post(url, model, f"question {turn}")
                    assert answer.status_code == 200, answer.text
                    replica = urls[answer.headers["x-prefix-router-replica"]]
                    assert replica in served[model or "llama"]
                    assert answer.json()["model"] == (model or "llama")
            unknown = post(url, "mistral", "hi")
            assert unknown.status_code == 404
            assert "'mistral' does not exist (served: llama, qwen, sql)" in unknown.text
            stats = gateway_stats(url)
            requests = {name: s.requests for name, s in stats.models.items()}
            assert requests == {"llama": 12, "qwen": 6, "sql": 6}
            assert stats.models["sql"].token_hit_rate > 0.5  # its own prefix, cached
            metrics = httpx.get(f"{url}/metrics").text
            assert 'prefix_router_model_requests_total{model="qwen"} 6.0' in metrics

            # an adapter loaded at run time is routed to once the gateway learns of it
            adapter = {"lora_name": "chat-qwen"}
            loaded = httpx.post(f"{replicas[2]}/v1/load_lora_adapter", json=adapter)
            assert loaded.status_code == 200
            deadline = time.monotonic() + 20
            while post(url, "chat-qwen", "hi").status_code == 404:
                assert time.monotonic() < deadline, "the gateway never learned the adapter"
                time.sleep(0.5)
            answer = post(url, "chat-qwen", "hello")
            assert urls[answer.headers["x-prefix-router-replica"]] == replicas[2]


def test_model_routes_keep_a_policy_and_a_fleet_per_model():
    routes = ModelRoutes(
        lambda model: make_policy("round_robin", time.monotonic, np.random.default_rng(0)),
        "llama",
    )
    a, b = ReplicaState("a", model="llama", adapters=frozenset({"sql"})), ReplicaState("b")
    q = ReplicaState("q", model="qwen")
    for state in (a, b, q):
        routes.added(state)
    assert routes.resolve(None) == ServedName("llama")
    assert routes.resolve("sql") == ServedName("llama", "sql")
    assert routes.resolve("qwen") == ServedName("qwen") and routes.resolve("x") is None
    assert routes.serving(ServedName("llama"), [a, b, q]) == [a, b]  # b said nothing: default
    assert routes.serving(ServedName("llama", "sql"), [a, b, q]) == [a]
    assert routes.policies.keys() == {"llama", "qwen"}
    routes.removed(a)
    routes.removed(b)
    assert routes.resolve(None) == ServedName("qwen")  # the only model served
    assert routes.names() == [("qwen", None)]


def test_an_adapters_events_key_to_the_identities_the_gateway_hashes():
    tokens = prompt(64)
    keys = EventKeys("llama", 16, 1)
    event = KVEvent(1, "stored", (1, 2, 3, 4), None, (), "GPU", tokens.tobytes(), "t", "sql")
    assert keys.stored(event) == prefix_keys(tokens, 16, 1, identity_seed("sql", "t"))
    assert keys.stored(event) != prefix_keys(tokens, 16, 1, identity_seed("llama", "t"))


def test_cache_aware_sends_a_cold_adapter_prompt_where_a_slot_holds_its_adapter():
    policy = make_policy("cache_aware", time.monotonic, np.random.default_rng(0))
    fleet = [ReplicaState(f"r{i}", 4096, model="llama") for i in range(4)]
    for state in fleet:
        policy.on_replica_added(state)
        state.loaded_adapters = ("geo",)
    fleet[2].loaded_adapters = ("geo", "sql")

    def cold(adapter: str, start: int) -> RoutingRequest:
        keys = prefix_keys(prompt(512, start), 16, 1, identity_seed(adapter))
        return RoutingRequest(f"r{start}", 512, keys, model="llama", adapter=adapter)

    assert {policy.choose(cold("sql", 1000 * i), fleet).replica_id for i in range(8)} == {"r2"}
    fleet[2].outstanding_requests = 40  # overloaded: the adapter is loaded elsewhere
    assert policy.choose(cold("sql", 99_000), fleet) is not fleet[2]
    # no slot holds it: every cold prompt of the adapter goes to one replica
    assert len({policy.choose(cold("chat", 1000 * i), fleet).replica_id for i in range(8)}) == 1
