"""What a chat request gives its template beside its messages, as vLLM 0.32 gives it
(``ChatCompletionToolsParam.model_dump``, ``build_chat_params``, ``merge_kwargs``)."""

import pytest

from replica.api.chat_variables import chat_variables, tokenize_variables
from replica.api.model_tokenizer import load_tokenizer
from replica.api.openai import ChatCompletionRequest, Rejected, TokenizeRequest
from router.path.envelope import request_prompts
from tests.shared import CHAT_TEMPLATE, build_hf_tokenizer

MESSAGES = [{"role": "user", "content": "hi"}]


def test_tools_are_dumped_as_vllms_model_dumps_them():
    """vLLM's field order (the order ``tojson`` writes), a null description and
    parameters kept, ``strict`` only when set, fields it does not know dropped."""
    tools = [
        {"function": {"parameters": {"b": 1, "a": 2}, "name": "f", "examples": []}, "x": 1},
        {"type": "function", "function": {"name": "g", "strict": True}, "defer_loading": True},
    ]
    variables = chat_variables({"messages": MESSAGES, "tools": tools})
    assert [list(tool) for tool in variables["tools"]] == [
        ["type", "function"],
        ["type", "function", "defer_loading"],
    ]
    first, second = (t["function"] for t in variables["tools"])
    assert first == {"name": "f", "description": None, "parameters": {"b": 1, "a": 2}}
    assert list(first["parameters"]) == ["b", "a"]  # the client's order within parameters
    assert second == {
        "name": "g",
        "description": None,
        "parameters": None,
        "strict": True,
        "defer_loading": True,  # the tool's, as vLLM propagates it
    }


def test_the_requests_own_fields_win_over_the_clients_template_arguments():
    body = {
        "messages": MESSAGES,
        "chat_template_kwargs": {
            "enable_thinking": True,
            "documents": [{"title": "mine", "text": "x"}],
            "unset": None,
            "auto": "auto",
            "add_generation_prompt": False,  # the request's field, never a variable
            "max_length": 4,  # transformers' own parameter
        },
        "documents": [{"title": "a", "text": "b"}],
        "reasoning_effort": "none",
    }
    assert chat_variables(body) == {
        "enable_thinking": True,  # named by the client: reasoning_effort leaves it
        "documents": [{"title": "a", "text": "b"}],
        "reasoning_effort": "none",
    }
    del body["chat_template_kwargs"]
    assert chat_variables(body)["enable_thinking"] is False  # "none": thinking off
    assert chat_variables({"messages": MESSAGES}) == {}


def test_tokenize_takes_tools_and_template_arguments_only():
    body = {
        "messages": MESSAGES,
        "tools": [{"type": "function", "function": {"name": "f"}}],
        "chat_template_kwargs": {"enable_thinking": False},
        "documents": [{"title": "a", "text": "b"}],
        "reasoning_effort": "low",
    }
    assert set(tokenize_variables(body)) == {"tools", "enable_thinking"}


@pytest.mark.parametrize(
    "fields",
    [
        {"tools": [{"type": "function", "function": {"description": "no name"}}]},
        {"tools": [{"type": "retrieval", "function": {"name": "f"}}]},
        {"chat_template_kwargs": ["enable_thinking"]},
        {"documents": [{"title": 1}]},
    ],
)
def test_fields_vllm_refuses_raise(fields):
    with pytest.raises(ValueError):
        chat_variables({"messages": MESSAGES, **fields})


def test_the_replica_renders_a_chat_and_its_tokenize_as_the_gateway_does(tmp_path):
    """Its chat completion and ``/tokenize`` give the template what the gateway gives it;
    a template that refuses the request is vLLM's 400, not a 500."""
    model = build_hf_tokenizer(tmp_path / "model")
    template = "{% if tools %}{{ tools | tojson }}{% endif %}{{ enable_thinking }}" + CHAT_TEMPLATE
    tokenizer = load_tokenizer(str(model), chat_template=template)
    tools = [{"type": "function", "function": {"name": "f", "description": "東京"}}]
    body = {"messages": MESSAGES, "tools": tools, "chat_template_kwargs": {"enable_thinking": 0}}
    gateway = request_prompts(body, True, tokenizer)[0].tolist()
    assert gateway != request_prompts({"messages": MESSAGES}, True, tokenizer)[0].tolist()
    assert ChatCompletionRequest(**body).prompt_ids(tokenizer).tolist() == gateway
    assert TokenizeRequest(**body).token_ids(tokenizer).tolist() == gateway
    refusing = load_tokenizer(str(model), chat_template="{{ raise_exception('no tools') }}")
    with pytest.raises(Rejected, match="no tools") as refused:
        TokenizeRequest(**body).token_ids(refusing)
    assert refused.value.status == 400
