"""The replica's HTTP server, run as a real `prefix-router replica` process."""

import json

import httpx
import pytest

from deploy.processes import running
from replica.api.config import ReplicaConfig
from replica.api.kv_events import KVEventPage, decode_page
from tests.shared import replica_stats

pytestmark = pytest.mark.slow

SYSTEM = "You are a careful assistant. " * 60


@pytest.fixture(scope="module")
def replica():
    with running(["replica", "--speedup", "20", "--num-blocks", "2048"]) as (url,):
        yield url


def post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=30)


def test_completions_accept_text_and_token_ids_and_report_cached_tokens(replica):
    # ignore_eos: the simulated model may end a reply early, like a real one
    first = post(
        replica, "/v1/completions", {"prompt": SYSTEM + "one", "max_tokens": 4, "ignore_eos": True}
    ).json()
    again = post(
        replica, "/v1/completions", {"prompt": SYSTEM + "two", "max_tokens": 4, "ignore_eos": True}
    ).json()
    assert first["object"] == "text_completion" and first["choices"][0]["finish_reason"]
    assert first["usage"]["completion_tokens"] == len(first["choices"][0]["text"]) // 4 == 4
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= 400
    ids = post(replica, "/v1/completions", {"prompt": list(range(100, 180)), "max_tokens": 2})
    assert ids.status_code == 200 and ids.json()["usage"]["prompt_tokens"] == 80


def test_chat_streams_sse_with_usage_and_done(replica):
    body = {
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "hi"}],
        "max_tokens": 5,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
    }
    with httpx.stream("POST", replica + "/v1/chat/completions", json=body, timeout=30) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in response.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[6:]) for line in lines[:-1]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert len(text) == 20
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 5


def test_models_health_stats_and_metrics(replica):
    assert httpx.get(replica + "/health").json() == {"status": "ok"}
    models = httpx.get(replica + "/v1/models").json()
    assert models["data"][0]["id"] == "sim-llama3-8b"
    post(replica, "/v1/completions", {"prompt": SYSTEM, "max_tokens": 1})
    stats = replica_stats(replica)  # the typed contract decodes the live answer
    assert stats.requests >= 1 and stats.cache.query_tokens > 0
    assert stats.config == ReplicaConfig(speedup=20, num_blocks=2048)
    # The host tier its profile's hardware holds by default: 256 GB under one H100.
    assert stats.cache.num_blocks == 2048 and stats.cache.host_num_blocks == 122_070
    metrics = httpx.get(replica + "/metrics").text
    for name in (
        "vllm:prefix_cache_queries_total",
        "vllm:prefix_cache_hits_total",
        "vllm:kv_cache_usage_perc",
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:time_to_first_token_seconds_bucket",
        "prefix_router:host_cache_hits_total",
        "prefix_router:kv_bytes_to_gpu_total",
        "prefix_router:host_cache_usage_perc",
    ):
        assert name in metrics, name
    queries = next(
        line for line in metrics.splitlines() if line.startswith("vllm:prefix_cache_queries_total")
    )
    assert float(queries.split()[-1]) == stats.cache.query_tokens


def kv_events(replica: str, since: int) -> KVEventPage:
    return decode_page(httpx.get(replica + "/kv_events", params={"since": since}).content)


def test_kv_events_follow_a_sequence_number_and_reset_clears(replica):
    start = kv_events(replica, 0)
    post(replica, "/v1/completions", {"prompt": "fresh words " * 40, "max_tokens": 1})
    after = kv_events(replica, start.last_seq)
    assert after.events and all(e.seq > start.last_seq for e in after.events)
    assert after.events[0].kind == "stored" and not after.lost and after.block_size == 16
    assert httpx.post(replica + "/reset").status_code == 200
    cleared = kv_events(replica, after.last_seq)
    assert [e.kind for e in cleared.events] == ["cleared"]
    assert replica_stats(replica).cache.query_tokens == 0


def test_reset_is_refused_while_requests_are_in_flight(replica):
    body = {"prompt": "slow", "max_tokens": 20_000, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", replica + "/v1/completions", json=body, timeout=30) as response:
        lines = response.iter_lines()  # held: dropping it would close the stream
        assert next(lines).startswith("data: ")
        assert httpx.post(replica + "/reset").status_code == 409


def test_a_client_that_disconnects_aborts_its_request(replica):
    body = {"prompt": "abandoned", "max_tokens": 2000, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", replica + "/v1/completions", json=body, timeout=30) as response:
        next(response.iter_lines())
    for _ in range(50):
        if replica_stats(replica).running == 0:
            break
        httpx.get(replica + "/health")
    assert replica_stats(replica).running == 0


TOOL = {"type": "function", "function": {"name": "weather", "parameters": {}}}
#: vLLM's refusals without its tool-call flags, in its words; and what the simulated
#: model cannot do that vLLM does with structured outputs.
TOOL_CHOICES_REFUSED = [
    ({"tools": []}, "`tools` must not be an empty array"),
    ({"tool_choice": "auto"}, "When using `tool_choice`, `tools` must be set."),
    ({"tools": [TOOL], "tool_choice": "any"}, "Invalid value for `tool_choice`: any!"),
    (
        {"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "other"}}},
        "does not match any of the specified `tools`",
    ),
    ({"tools": [TOOL], "tool_choice": "required"}, "the simulated model cannot be made to call"),
]


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ({"prompt": 5}, "prompt"),
        ({"prompt": "x", "max_tokens": -1}, "max_tokens"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role"),
        ({"prompt": [-1, 2]}, "prompt"),
        ({"prompt": "x" * 400_000, "max_tokens": 1}, "exceeds the KV cache"),
        ({"prompt": "x", "suffix": "y"}, "suffix is only supported for models with FIM"),
        ({"prompt": "x", "logit_bias": {"word": 5}}, "in logit_bias are not token ids"),
        *[
            ({"messages": [{"role": "user", "content": "x"}], **fields}, message)
            for fields, message in TOOL_CHOICES_REFUSED
        ],
        (
            {"prompt": "x", "max_tokens": 4, "min_tokens": 9},
            "min_tokens must be less than or equal to max_tokens=4, got 9.",
        ),
    ],
)
def test_bad_requests_get_a_400_naming_the_problem(replica, body, needle):
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    response = post(replica, path, body)
    assert response.status_code == 400
    assert (
        needle in response.json()["error"]["message"] or needle == response.json()["error"]["param"]
    )


def test_a_model_it_does_not_serve_is_a_404_as_vllm_answers(replica):
    for path, body in [
        ("/v1/completions", {"prompt": "x"}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}),
    ]:
        refused = post(replica, path, {**body, "model": "gpt-9", "max_tokens": 1})
        assert refused.status_code == 404
        assert refused.json()["error"]["param"] == "model" and "gpt-9" in refused.text
        for model in ("sim-llama3-8b", None):  # its own, or none named
            assert post(replica, path, {**body, "model": model, "max_tokens": 1}).status_code == 200


def test_tool_choice_auto_or_none_is_answered_with_text_as_vllm_without_tool_flags(replica):
    for choice in ("auto", "none", None):
        body = {
            "messages": [{"role": "user", "content": "rain?"}],
            "tools": [TOOL],
            "tool_choice": choice,
            "max_tokens": 3,
            "ignore_eos": True,
        }
        answer = post(replica, "/v1/chat/completions", body)
        assert answer.status_code == 200, answer.text
        message = answer.json()["choices"][0]["message"]
        assert message["content"] and not message.get("tool_calls")


def test_logit_bias_and_min_tokens_do_what_vllm_does_with_them(replica):
    word = "kin "  # one token of the simulated model's vocabulary
    token = int.from_bytes(word.encode(), "little")
    body = {"prompt": "x", "max_tokens": 5, "logit_bias": {str(token): 100}}
    assert post(replica, "/v1/completions", body).json()["choices"][0]["text"] == word * 5
    ended = {"prompt": "x", "max_tokens": 40, "seed": 0}  # this seed draws EOS at token 13
    assert post(replica, "/v1/completions", ended).json()["usage"]["completion_tokens"] == 13
    held = {**ended, "min_tokens": 40}
    assert post(replica, "/v1/completions", held).json()["usage"]["completion_tokens"] == 40


def test_echo_writes_each_prompt_before_its_completion(replica):
    body = {"prompt": ["Echo me. ", "And me. "], "max_tokens": 3, "echo": True, "seed": 1}
    whole = post(replica, "/v1/completions", body).json()["choices"]
    plain = post(replica, "/v1/completions", {**body, "echo": False}).json()["choices"]
    assert [c["text"] for c in whole] == [
        p + c["text"] for p, c in zip(body["prompt"], plain, strict=True)
    ]
    with httpx.stream("POST", replica + "/v1/completions", json={**body, "stream": True}) as r:
        chunks = [json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: {")]
    streamed = ["", ""]
    for chunk in chunks:
        streamed[chunk["choices"][0]["index"]] += chunk["choices"][0]["text"]
    assert streamed == [c["text"] for c in whole]
    refused = post(replica, "/v1/completions", {**body, "logprobs": 1})
    assert refused.status_code == 400 and "echo with logprobs" in refused.text


def test_invalid_json_is_a_400(replica):
    response = httpx.post(
        replica + "/v1/completions", content=b"{nope", headers={"content-type": "application/json"}
    )
    assert response.status_code == 400 and "invalid JSON" in response.json()["error"]["message"]


def test_a_batch_refused_for_one_prompt_leaves_nothing_queued(replica):
    body = {"prompt": ["a short one", "x" * 400_000], "max_tokens": 20_000, "ignore_eos": True}
    response = post(replica, "/v1/completions", body)
    assert response.status_code == 400 and "exceeds the KV cache" in response.text
    stats = replica_stats(replica)
    assert (stats.running, stats.waiting) == (0, 0), "the batch's first prompt is still queued"


def test_n_choices_share_one_prefill_of_their_prompt(replica):
    """As vLLM's parallel sampling: the prompt is computed once, and the other choices
    find its full blocks cached (they compute only its last, partial block)."""
    body = {"prompt": "fresh words for n " * 150, "max_tokens": 4, "n": 4, "ignore_eos": True}
    before = replica_stats(replica).cache
    answer = post(replica, "/v1/completions", body).json()
    after = replica_stats(replica).cache
    prompt_tokens = answer["usage"]["prompt_tokens"]
    shared = (prompt_tokens - 1) // 16 * 16
    assert len(answer["choices"]) == 4 and answer["usage"]["prompt_tokens_details"] is not None
    assert after.query_tokens - before.query_tokens == 4 * prompt_tokens
    assert after.hit_tokens - before.hit_tokens == 3 * shared


def test_a_client_that_disconnects_aborts_every_choice(replica):
    body = {"prompt": "abandoned " * 100, "max_tokens": 2000, "n": 3, "ignore_eos": True}
    with httpx.stream(
        "POST", replica + "/v1/completions", json={**body, "stream": True}, timeout=30
    ) as response:
        next(response.iter_lines())
    for _ in range(50):
        if replica_stats(replica).running == 0:
            break
        httpx.get(replica + "/health")
    stats = replica_stats(replica)
    assert (stats.running, stats.waiting) == (0, 0)
