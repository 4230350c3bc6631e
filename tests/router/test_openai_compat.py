"""The OpenAI API as vLLM serves it, through the gateway to our replicas.

Every request below is one a common client sends; every answer is checked against
the official ``openai`` client's own response models. The last tests send the same
bodies straight to a replica and through the gateway: the gateway must answer with
the same status and the same shape, never refusing what the backend accepts.
"""

import json

import httpx
import numpy as np
import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from deploy.processes import running
from replica.api.tokenizer import ByteTokenizer
from tests.shared import gateway_stats

pytestmark = pytest.mark.slow

SYSTEM = "You are a compatibility test. " * 40
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"


@pytest.fixture(scope="module")
def fleet():
    replica = ["replica", "--speedup", "50", "--num-blocks", "2048", "--host-blocks", "0"]
    with running(replica, replica) as replicas:
        gateway = ["gateway", *[f"--backend={url}" for url in replicas]]
        with running(gateway) as (url,):
            yield url, replicas


def post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(url + path, json={"max_tokens": 6, "ignore_eos": True, **body}, timeout=30)


def chat(url: str, **body) -> ChatCompletion:
    response = post(url, CHAT, body)
    assert response.status_code == 200, response.text
    return ChatCompletion.model_validate(response.json())


def completion(url: str, **body) -> Completion:
    response = post(url, COMPLETIONS, body)
    assert response.status_code == 200, response.text
    return Completion.model_validate(response.json())


def sse(response: httpx.Response) -> list[dict]:
    lines = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


# ----------------------------------------------------------------- request shapes


def test_content_parts_are_joined_as_vllm_joins_them(fleet):
    url, _ = fleet
    parts = [{"type": "text", "text": SYSTEM}, {"type": "text", "text": "Be brief."}]
    as_parts = {"role": "system", "content": parts}
    as_text = {"role": "system", "content": f"{SYSTEM}\nBe brief."}
    first = chat(url, messages=[as_parts, {"role": "user", "content": "one"}])
    joined = chat(url, messages=[as_text, {"role": "user", "content": "two"}])
    assert first.choices[0].message.content
    shared = ByteTokenizer().apply_chat_template([{"role": "system", "content": SYSTEM}])
    # The parts render exactly as the joined text: the second request hits their blocks.
    assert joined.usage.prompt_tokens_details.cached_tokens >= len(shared) // 16 * 16 - 16


def test_a_tool_conversation_with_null_content_and_tool_results(fleet):
    url, replicas = fleet
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "weather", "arguments": '{"city": "Paris"}'},
    }
    tool = {"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'},
        {"role": "developer", "content": "Answer in one line."},
    ]
    answer = chat(url, messages=messages, tools=[tool], tool_choice="auto")
    assert answer.choices[0].finish_reason == "length"
    # The prompt the model read holds the call, its result and the instruction, in order.
    ids = httpx.post(f"{replicas[0]}/tokenize", json={"messages": messages}).json()["tokens"]
    text = ByteTokenizer().decode(ids)
    parts = ['"name":"weather"', '{"temp": 21}', "Answer in one line."]
    found = [text.find(part) for part in parts]
    assert -1 not in found and found == sorted(found), text
    assert answer.usage.prompt_tokens == len(ids)


def test_n_samples_each_choice_independently_and_counts_the_prompt_once(fleet):
    url, _ = fleet
    one = chat(url, messages=[{"role": "user", "content": "sample me"}])
    three = chat(url, messages=[{"role": "user", "content": "sample me"}], n=3)
    assert [c.index for c in three.choices] == [0, 1, 2]
    assert len({c.message.content for c in three.choices}) == 3
    assert three.usage.prompt_tokens == one.usage.prompt_tokens
    assert three.usage.completion_tokens == 3 * 6
    texts = completion(url, prompt="sample me too", n=2)
    assert [c.index for c in texts.choices] == [0, 1] and texts.usage.completion_tokens == 12


def test_a_seed_makes_the_answer_repeatable(fleet):
    url, _ = fleet
    body = {"messages": [{"role": "user", "content": "seeded"}], "n": 2}
    first, again = chat(url, seed=7, **body), chat(url, seed=7, **body)
    other = chat(url, seed=8, **body)
    assert [c.message.content for c in first.choices] == [c.message.content for c in again.choices]
    assert [c.message.content for c in first.choices] != [c.message.content for c in other.choices]


def test_batched_prompts_answer_one_choice_per_prompt(fleet):
    url, _ = fleet
    texts = completion(url, prompt=["first prompt", "other prompt", "third prompt"])
    assert [c.index for c in texts.choices] == [0, 1, 2]
    single = completion(url, prompt="first prompt")
    assert texts.usage.prompt_tokens == 3 * single.usage.prompt_tokens
    tokens = completion(url, prompt=[[1, 2, 3, 4], [5, 6, 7, 8, 9]], n=2)
    assert [c.index for c in tokens.choices] == [0, 1, 2, 3]  # prompt-major, as OpenAI
    assert tokens.usage.prompt_tokens == 9 and tokens.usage.completion_tokens == 4 * 6


def test_logprobs_are_well_formed(fleet):
    url, _ = fleet
    answer = chat(
        url, messages=[{"role": "user", "content": "logprobs"}], logprobs=True, top_logprobs=3
    )
    content = answer.choices[0].logprobs.content
    assert len(content) == 6
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
        assert all(alt.logprob <= entry.logprob for alt in entry.top_logprobs)
        assert bytes(entry.bytes).decode() == entry.token
    assert "".join(e.token for e in content) == answer.choices[0].message.content
    text = completion(url, prompt="logprobs", logprobs=5, max_tokens=200).choices[0]
    # Keyed by text: an alternative equal to the token (or to another) would shrink a dict.
    assert len(text.logprobs.tokens) == 200
    assert all(len(top) == 6 for top in text.logprobs.top_logprobs)
    assert text.logprobs.text_offset[0] == 0 and "".join(text.logprobs.tokens) == text.text


def test_a_stop_string_ends_the_choice_before_it(fleet):
    url, _ = fleet
    body = {"messages": [{"role": "user", "content": "stop me"}], "seed": 3, "max_tokens": 30}
    full = chat(url, **body).choices[0].message.content
    stop = full[12:17]  # a string the seeded answer is known to contain
    cut = chat(url, stop=[stop, "never appears"], **body).choices[0]
    assert cut.finish_reason == "stop" and cut.message.content == full[: full.index(stop)]
    streamed = post(url, CHAT, {**body, "stop": stop, "stream": True})
    chunks = [ChatCompletionChunk.model_validate(c) for c in sse(streamed)]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full[: full.index(stop)] and chunks[-1].choices[0].finish_reason == "stop"


def test_streaming_with_usage_and_several_choices(fleet):
    url, _ = fleet
    body = {
        "messages": [{"role": "user", "content": "stream two"}],
        "n": 2,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    chunks = [ChatCompletionChunk.model_validate(c) for c in sse(post(url, CHAT, body))]
    roles = [c.choices[0].index for c in chunks[:2]]
    assert roles == [0, 1] and all(c.choices[0].delta.role == "assistant" for c in chunks[:2])
    for index in (0, 1):
        mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == index]
        assert len("".join(c.delta.content or "" for c in mine)) == 6 * 4
        assert mine[-1].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12


# ----------------------------------------------------------------- refused as vLLM refuses


IMAGE = {"type": "image_url", "image_url": {"url": "http://x/cat.png"}}


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ({"temperature": 5}, "temperature"),
        ({"temperature": -0.5}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"presence_penalty": 3}, "presence_penalty"),
        ({"frequency_penalty": -2.5}, "frequency_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"temperature": 0, "n": 2}, "n must be 1 when using greedy sampling"),
        ({"stop": [""]}, "stop cannot contain an empty string"),
        ({"top_logprobs": 2}, "`logprobs` must be set to true"),
        ({"messages": [{"role": "user", "content": [IMAGE]}]}, "content part 'image_url'"),
    ],
)
def test_out_of_range_and_unsupported_requests_get_vllms_400(fleet, body, needle):
    url, _ = fleet
    response = post(url, CHAT, {"messages": [{"role": "user", "content": "x"}], **body})
    assert response.status_code == 400, response.text
    assert needle in response.json()["error"]["message"]


def test_what_the_gateway_cannot_read_it_forwards_and_counts(fleet):
    url, replicas = fleet
    before = gateway_stats(url).unread_prompts
    image = {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}
    via_gateway = post(url, CHAT, {"messages": [image]})
    direct = post(replicas[0], CHAT, {"messages": [image]})
    assert via_gateway.status_code == direct.status_code == 400
    assert via_gateway.json()["error"]["message"] == direct.json()["error"]["message"]
    assert gateway_stats(url).unread_prompts == before + 1


# ----------------------------------------------------------------- the same, with or without


def shape(value: object, keyed_by_token: bool = False) -> object:
    """The structure of a JSON value: keys and types, not ids, times or text (a
    completion's ``top_logprobs`` maps tokens, whatever they are, to numbers)."""
    if isinstance(value, dict) and keyed_by_token:
        return {"<token>": sorted({type(v).__name__ for v in value.values()})}
    if isinstance(value, dict):
        return {
            key: shape(item, key == "top_logprobs")
            for key, item in value.items()
            if key not in ("id", "created")
        }
    if isinstance(value, list):
        items = [shape(item, keyed_by_token) for item in value[:1]]
        return items + (["..."] if len(value) > 1 else [])
    return type(value).__name__


SAME_BODIES = [
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "text", "text": "parts"}]}]}),
    (CHAT, {"messages": [{"role": "user", "content": "n"}], "n": 2, "seed": 1}),
    (CHAT, {"messages": [{"role": "user", "content": "lp"}], "logprobs": True, "top_logprobs": 1}),
    (CHAT, {"messages": [{"role": "user", "content": "t"}], "temperature": 5}),
    (
        CHAT,
        {
            "messages": [
                {"role": "assistant", "content": None, "tool_calls": []},
                {"role": "user", "content": "after tools"},
            ]
        },
    ),
    (CHAT, {"messages": [{"role": "wizard", "content": "who?"}]}),
    (CHAT, {"messages": "not a list"}),
    (COMPLETIONS, {"prompt": ["a", "b"], "user": "u-1", "response_format": {"type": "text"}}),
    (COMPLETIONS, {"prompt": [[1, 2], [3]], "logprobs": 1}),
    (COMPLETIONS, {"prompt": [], "max_tokens": 2}),
    (COMPLETIONS, {"prompt": [2**33]}),
    (COMPLETIONS, {"prompt": "x", "top_p": 1.5}),
    (COMPLETIONS, {"prompt": {"text": "a dict"}}),
]


@pytest.mark.parametrize(("path", "body"), SAME_BODIES)
def test_the_gateway_answers_as_the_replica_does(fleet, path, body):
    url, replicas = fleet
    direct, via_gateway = post(replicas[0], path, body), post(url, path, body)
    assert via_gateway.status_code == direct.status_code, (direct.text, via_gateway.text)
    assert shape(via_gateway.json()) == shape(direct.json())
    if direct.status_code == 200:
        model = ChatCompletion if path == CHAT else Completion
        model.model_validate(via_gateway.json())
        assert len(via_gateway.json()["choices"]) == len(direct.json()["choices"])


def test_every_answer_is_counted_once_in_the_usage(fleet):
    url, _ = fleet
    prompt = list(np.arange(1, 200).tolist())
    first = completion(url, prompt=prompt)
    again = completion(url, prompt=[prompt, prompt], n=2)
    assert again.usage.prompt_tokens == 2 * first.usage.prompt_tokens
    # Both prompts are the same and cached by the first request: every one counts.
    assert again.usage.prompt_tokens_details.cached_tokens == 2 * 192
