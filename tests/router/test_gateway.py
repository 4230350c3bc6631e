"""The gateway in front of real replica processes, driven by the official openai client."""

import json

import httpx
import numpy as np
import openai
import pytest
import xxhash

from deploy.processes import running
from replica.api.tokenizer import ByteTokenizer
from tests.shared import gateway_stats

pytestmark = pytest.mark.slow

SYSTEM = "You answer questions about the fleet. " * 50


@pytest.fixture(scope="module")
def fleet():
    replica = ["replica", "--speedup", "20", "--num-blocks", "2048"]
    with running(replica, replica) as replicas:
        gateway = ["gateway", *[f"--backend={url}" for url in replicas], "--policy", "cache_aware"]
        with running(gateway) as (url,):
            yield url, replicas


@pytest.fixture
def client(fleet):
    return openai.OpenAI(base_url=fleet[0] + "/v1", api_key="unused", max_retries=0)


def chat(client, question: str, system: str = SYSTEM, **kwargs):
    return client.chat.completions.create(
        model="sim-llama3-8b",
        messages=[{"role": "system", "content": system}, {"role": "user", "content": question}],
        max_tokens=4,
        extra_body={"ignore_eos": True},  # the simulated model may otherwise stop early
        **kwargs,
    )


def test_the_openai_client_completes_chat_and_sees_cached_tokens_grow(client):
    first = chat(client, "What is a replica?")
    second = chat(client, "What is a router?")
    assert first.choices[0].message.content and first.choices[0].finish_reason == "length"
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens >= 400


def test_the_openai_client_streams_through_the_gateway(client):
    chat(client, "warm up", system="Stream system prompt. " * 40)
    stream = chat(
        client,
        "Stream me an answer",
        system="Stream system prompt. " * 40,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert len(text) == 16
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens >= 200


def test_completions_stream_and_not(client):
    prompt = "Completion prompt words. " * 40
    whole = client.completions.create(
        model="sim-llama3-8b", prompt=prompt, max_tokens=3, extra_body={"ignore_eos": True}
    )
    assert whole.usage.completion_tokens == 3
    streamed = list(
        client.completions.create(model="sim-llama3-8b", prompt=prompt, max_tokens=3, stream=True)
    )
    assert "".join(c.choices[0].text for c in streamed) and all(c.usage is None for c in streamed)


def test_a_conversation_sticks_to_the_replica_that_holds_it(fleet, client):
    url, _ = fleet
    system = "Sticky conversation. " * 60
    before = {b["url"]: b["dispatched"] for b in httpx.get(url + "/stats").json()["backends"]}
    for turn in range(4):
        reply = chat(client, f"turn {turn}", system=system)
        if turn:
            assert reply.usage.prompt_tokens_details.cached_tokens >= 300
    after = {b["url"]: b["dispatched"] for b in httpx.get(url + "/stats").json()["backends"]}
    assert sorted(after[u] - before[u] for u in after) == [0, 4]


def shared_tokens(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if len(differ) else n


def test_every_prediction_is_the_cached_prefix_the_replica_then_reports(fleet):
    """Questions after one system prompt: each request's cached tokens are known (the
    rendered prompts' shared tokens, in whole blocks), and so is what the router must
    predict (the same, in whole strides of 64 tokens). Both are pinned per request."""
    url, _ = fleet
    system = {"role": "system", "content": "Pinned prediction prefix. " * 200}
    prompts, replicas = [], set()
    for turn in range(4):
        messages = [system, {"role": "user", "content": f"Question number {turn}?"}]
        prompt = ByteTokenizer().apply_chat_template(messages)
        body = {"messages": messages, "max_tokens": 2, "ignore_eos": True}
        answer = httpx.post(url + "/v1/chat/completions", json=body, timeout=30)
        cached = answer.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        predicted = int(answer.headers["x-prefix-router-predicted-cached-tokens"])
        shared = max((shared_tokens(prompt, p) for p in prompts), default=0)
        shared = min(shared, len(prompt) - 1)  # the engine computes the last token
        assert (predicted, cached) == (shared // 64 * 64, shared // 16 * 16), turn
        prompts.append(prompt)
        replicas.add(answer.headers["x-prefix-router-replica"])
    assert shared > 1000 and len(replicas) == 1  # the cached prefix was long, and followed


def test_a_long_conversations_turns_keep_their_keys_and_predict_exactly(fleet):
    """A 5,000-token conversation, turn after turn: the gateway hashes each turn's new
    tokens only (router/index/key_cache.py), and still predicts exactly what is cached."""
    url, _ = fleet
    before = gateway_stats(url).key_cache
    messages = [{"role": "system", "content": "A long shared history of this chat. " * 560}]
    prompts = []
    for turn in range(3):
        messages.append({"role": "user", "content": f"Question {turn} about the history?"})
        prompt = ByteTokenizer().apply_chat_template(messages)
        body = {"messages": messages, "max_tokens": 4, "ignore_eos": True}
        answer = httpx.post(url + "/v1/chat/completions", json=body, timeout=30)
        predicted = int(answer.headers["x-prefix-router-predicted-cached-tokens"])
        shared = max((shared_tokens(prompt, p) for p in prompts), default=0)
        assert predicted == min(shared, len(prompt) - 1) // 64 * 64, turn
        prompts.append(prompt)
        reply = answer.json()["choices"][0]["message"]["content"]
        messages.append({"role": "assistant", "content": reply})
    after = gateway_stats(url).key_cache
    assert before is not None and after is not None and len(prompts[0]) > 5000
    assert (after.hits - before.hits, after.misses - before.misses) == (2, 1)
    assert after.kept_keys - before.kept_keys >= 2 * (len(prompts[0]) // 64 - 1)


def test_load_returns_to_zero_and_predictions_are_counted(fleet, client):
    url, _ = fleet
    for i in range(3):
        chat(client, f"prediction {i}", system="Predicted prefix. " * 80)
    for backend in gateway_stats(url).backends:
        assert backend.outstanding_requests == 0 and backend.outstanding_prefill_tokens == 0
        for counts in backend.by_policy.values():
            assert counts.close_predictions <= counts.predictions <= counts.requests
        assert backend.kv_events is True
    metrics = httpx.get(url + "/metrics").text
    assert "prefix_router_routing_decisions_total" in metrics
    assert "prefix_router_gateway_overhead_seconds_bucket" in metrics


def test_a_client_that_disconnects_mid_stream_releases_the_load(fleet):
    url, _ = fleet
    body = {"prompt": "long answer", "max_tokens": 5000, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as response:
        lines = response.iter_lines()
        assert next(lines).startswith("data: ")
    for _ in range(100):
        backends = httpx.get(url + "/stats").json()["backends"]
        if all(b["outstanding_requests"] == 0 for b in backends):
            break
    assert all(b["outstanding_requests"] == 0 for b in backends)


def test_the_policy_can_be_switched_at_run_time(fleet, client):
    url, _ = fleet
    assert httpx.post(url + "/admin/policy", json={"policy": "round_robin"}).json() == {
        "policy": "round_robin"
    }
    assert httpx.get(url + "/stats").json()["policy"] == "round_robin"
    chat(client, "round robin now")
    bad = httpx.post(url + "/admin/policy", json={"policy": "telepathy"})
    assert bad.status_code == 400 and "unknown policy" in bad.json()["error"]["message"]
    # Priced in seconds, from the replicas' profile and their reported free KV blocks.
    assert httpx.post(url + "/admin/policy", json={"policy": "cache_aware_ttft"}).status_code == 200
    system = "A prompt for routing in seconds. " * 60
    chat(client, "first", system=system)
    again = chat(client, "second", system=system)
    assert again.usage.prompt_tokens_details.cached_tokens >= 400  # it went where the prefix is
    backends = httpx.get(url + "/stats").json()["backends"]
    assert all(b["free_blocks"] is not None for b in backends)
    assert httpx.post(url + "/admin/policy", json={"policy": "cache_aware"}).status_code == 200


def test_a_hot_prompts_replication_set_is_in_stats_and_on_the_dashboard(fleet, client):
    url, _ = fleet
    switched = httpx.post(url + "/admin/policy", json={"policy": "cache_aware_replicated"})
    assert switched.status_code == 200
    try:
        system = "A prompt every user of this app sends first. " * 40
        for i in range(40):  # popular after 16: all the traffic, two replicas' worth
            chat(client, f"question {i}", system=system)
        (hot,) = httpx.get(url + "/stats").json()["hot_sets"]
        assert hot["share"] > 0.5 and len(hot["replicas"]) == 2 and len(hot["prefix"]) == 16
        board = httpx.get(url + "/dashboard/data").json()
        spread = [h["replicated_on"] for h in board["hot_prefixes"] if h["replicated_on"]]
        assert spread and sorted(spread[0]) == sorted(hot["replicas"])
    finally:
        httpx.post(url + "/admin/policy", json={"policy": "cache_aware"})
    assert httpx.get(url + "/stats").json()["hot_sets"] == []


def test_backends_can_be_added_and_removed_at_run_time(fleet):
    url, replicas = fleet
    assert httpx.delete(url + "/admin/backends", params={"url": replicas[1]}).status_code == 200
    assert [b["url"] for b in httpx.get(url + "/stats").json()["backends"]] == [replicas[0]]
    body = {"prompt": "only one replica left", "max_tokens": 2}
    assert httpx.post(url + "/v1/completions", json=body, timeout=30).status_code == 200
    added = httpx.post(url + "/admin/backends", json={"url": replicas[1]})
    assert added.status_code == 200
    assert len(httpx.get(url + "/stats").json()["backends"]) == 2
    assert httpx.post(url + "/admin/backends", json={"url": "ftp://x"}).status_code == 400
    assert (
        httpx.delete(url + "/admin/backends", params={"url": "http://nowhere"}).status_code == 404
    )


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ({"prompt": 3}, "prompt"),
        ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
        ({"prompt": "x", "stream": "maybe"}, "stream"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "user"}]}, "content is required in a user message"),
    ],
)
def test_bad_input_gets_a_clear_400_from_the_replica_through_the_gateway(fleet, body, needle):
    url, _ = fleet
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    response = httpx.post(url + path, json=body, timeout=30)
    assert response.status_code == 400
    assert needle in response.json()["error"]["message"]


def test_the_gateway_rejects_invalid_json(fleet):
    url, _ = fleet
    response = httpx.post(
        url + "/v1/completions", content=b"[1,", headers={"content-type": "application/json"}
    )
    assert response.status_code == 400 and "invalid JSON" in response.json()["error"]["message"]
    response = httpx.post(url + "/v1/completions", content=json.dumps([1, 2]).encode())
    assert response.status_code == 400


def test_a_session_key_sends_every_turn_where_rendezvous_hashing_of_it_says(fleet):
    """Routers that learn from their own decisions agree on a session's replica without
    talking: its key, hashed against the replicas' ids, names it."""
    url, _ = fleet
    assert (
        httpx.post(url + "/admin/policy", json={"policy": "cache_aware_approx"}).status_code == 200
    )
    ids = [b["replica_id"] for b in httpx.get(url + "/stats").json()["backends"]]

    def home_of(key: str) -> str:
        return max(ids, key=lambda i: xxhash.xxh3_64_intdigest(key.encode() + i.encode()))

    # Four sessions homed on each replica (the ids are URLs on random ports: eight
    # keys drawn blindly all land on one replica once in 128 runs).
    keys = [f"user-{n}" for n in range(1000)]
    homed = {i: [k for k in keys if home_of(k) == i] for i in ids}
    assert all(300 < len(homed[i]) < 700 for i in ids)  # the keys spread the sessions
    chosen = [key for i in ids for key in homed[i][:4]]
    for session, key in enumerate(chosen):
        home = home_of(key)
        history = f"Session {session} talks about its own topic. " * 20
        for turn in range(2):
            history += f" Turn {turn}."
            response = httpx.post(
                url + "/v1/completions",
                json={"prompt": history, "max_tokens": 2},
                headers={"x-session-id": key},
                timeout=30,
            )
            assert response.headers["x-prefix-router-replica"] == home, (key, turn)
    assert httpx.post(url + "/admin/policy", json={"policy": "cache_aware"}).status_code == 200


def test_the_session_key_is_read_where_the_gateway_is_told():
    from router.path.envelope import Envelope
    from router.path.resolve import session_key

    envelope = Envelope.of({"prompt": "hi", "user": "alice"}, headers={"x-session-id": "abc"})
    assert session_key(envelope, "x-session-id") == "abc"
    assert session_key(envelope, "user") == "alice"
    assert session_key(envelope, "x-other") is None
    assert session_key(envelope, "") is None
    assert session_key(Envelope.of({"user": 3}), "user") is None
