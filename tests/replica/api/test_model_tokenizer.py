"""A Hugging Face tokenizer and its chat template, as vLLM's OpenAI server applies them."""

import json

import numpy as np
import pytest
from tokenizers import Tokenizer as RustTokenizer

from replica.api.chat_variables import chat_variables
from replica.api.model_tokenizer import load_tokenizer
from replica.engine import Engine, EngineConfig, EngineRequest
from tests.shared import build_hf_tokenizer

CHAT = [
    {"role": "system", "content": "You are a helpful assistant for a bicycle shop."},
    {"role": "user", "content": "How do I true a wheel?"},
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_hf_tokenizer(tmp_path_factory.mktemp("model"))


@pytest.fixture(scope="module")
def rust(model_dir):
    return RustTokenizer.from_file(str(model_dir / "tokenizer.json"))


def test_a_prompt_is_encoded_with_the_tokenizers_special_tokens(model_dir, rust):
    tokenizer = load_tokenizer(str(model_dir))
    ids = tokenizer.encode("The quick brown fox")
    assert ids.tolist() == rust.encode("The quick brown fox").ids
    assert ids[0] == rust.token_to_id("<|begin|>")  # the BOS its post-processor adds
    assert tokenizer.decode(ids) == "The quick brown fox"
    assert load_tokenizer(str(model_dir / "tokenizer.json")).encode("fox").tolist() == (
        rust.encode("fox").ids
    )


def test_a_conversation_is_rendered_by_the_models_template_and_encoded_as_is(model_dir, rust):
    tokenizer = load_tokenizer(str(model_dir))
    ids = tokenizer.apply_chat_template(CHAT)
    text = (
        "<|begin|><|start_header|>system<|end_header|>\n\n"
        "You are a helpful assistant for a bicycle shop.<|eot|>"
        "<|start_header|>user<|end_header|>\n\nHow do I true a wheel?<|eot|>"
        "<|start_header|>assistant<|end_header|>\n\n"
    )
    assert ids.tolist() == rust.encode(text, add_special_tokens=False).ids
    assert ids.tolist().count(rust.token_to_id("<|begin|>")) == 1  # the template's BOS only
    without = tokenizer.apply_chat_template(CHAT, add_generation_prompt=False)
    assert ids[: len(without)].tolist() == without.tolist()


def test_a_given_chat_template_replaces_the_tokenizers(model_dir, tmp_path, rust):
    template = tmp_path / "plain.jinja"
    template.write_text("{% for m in messages %}{{ m['content'] }}\n{% endfor %}")
    tokenizer = load_tokenizer(str(model_dir), chat_template=str(template))
    assert tokenizer.decode(tokenizer.apply_chat_template(CHAT)) == (
        "You are a helpful assistant for a bicycle shop.\nHow do I true a wheel?\n"
    )
    inline = load_tokenizer(str(model_dir), chat_template="{{ messages[0]['content'] }}")
    assert (
        inline.apply_chat_template(CHAT).tolist()
        == rust.encode(CHAT[0]["content"], add_special_tokens=False).ids
    )


#: A template that uses what vLLM gives it beside the messages, as models' templates do.
TOOLS_TEMPLATE = (
    "{% if tools is not none %}{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}"
    "{{ tools[0] | tojson(indent=2) }}\n{% endif %}{% if documents is none %}-\n{% endif %}"
    "{% for m in messages %}{{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}> "
    "{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}"
    "{% endif %}"
)
TOOL = {
    "type": "function",
    "function": {"name": "météo", "description": "<b>Zürich</b> & 東京", "parameters": {}},
}


def test_tools_and_template_arguments_render_as_transformers_renders_them(model_dir, rust):
    """transformers' ``tojson`` (non-ASCII and HTML as they are, its ``indent``), tools
    and documents none unless given: the text vLLM renders, token for token."""
    transformers = pytest.importorskip("transformers")  # vLLM's: the vllm extra installs it
    hf = transformers.PreTrainedTokenizerFast(tokenizer_file=str(model_dir / "tokenizer.json"))
    ours = load_tokenizer(str(model_dir), chat_template=TOOLS_TEMPLATE)
    with_tools = chat_variables(
        {"tools": [TOOL], "chat_template_kwargs": {"enable_thinking": False}}
    )
    for variables in ({}, with_tools):
        text = hf.apply_chat_template(
            CHAT,
            chat_template=TOOLS_TEMPLATE,
            add_generation_prompt=True,
            tokenize=False,
            **variables,
        )
        ids = ours.apply_chat_template(CHAT, variables=variables)
        assert ids.tolist() == rust.encode(text, add_special_tokens=False).ids
    assert "東京" in text and "<think></think>" in text


def test_a_conversation_with_tools_takes_the_models_tool_use_template(model_dir, tmp_path):
    folder = tmp_path / "named"
    folder.mkdir()
    (folder / "tokenizer.json").write_text((model_dir / "tokenizer.json").read_text())
    named = [
        {"name": "default", "template": "plain {{ messages[0]['content'] }}"},
        {"name": "tool_use", "template": "tools {{ tools[0]['function']['name'] }}"},
    ]
    config = {"eos_token": "<|eot|>", "chat_template": named}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    tokenizer = load_tokenizer(str(folder))
    assert tokenizer.decode(tokenizer.apply_chat_template(CHAT)).startswith("plain")
    tools = chat_variables({"tools": [TOOL]})
    assert tokenizer.decode(tokenizer.apply_chat_template(CHAT, variables=tools)) == "tools météo"


def test_templates_and_tokenizers_that_cannot_serve_say_why(model_dir, tmp_path):
    strict = load_tokenizer(
        str(model_dir),
        chat_template="{% if messages[0]['role'] != 'user' %}"
        "{{ raise_exception('conversations start with the user') }}{% endif %}",
    )
    with pytest.raises(ValueError, match="chat template: conversations start with the user"):
        strict.apply_chat_template(CHAT)
    with pytest.raises(ValueError, match="chat template line 1"):
        load_tokenizer(str(model_dir), chat_template="{% for m in messages %}")
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "tokenizer.json").write_text((model_dir / "tokenizer.json").read_text())
    config = {"eos_token": {"content": "<|eot|>", "special": True}}
    (bare / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="has no chat template: give one"):
        load_tokenizer(str(bare)).apply_chat_template(CHAT)
    (bare / "tokenizer_config.json").write_text("{}")
    with pytest.raises(ValueError, match="no eos_token"):
        load_tokenizer(str(bare))
    with pytest.raises(ValueError, match=r"no tokenizer\.json in"):
        load_tokenizer(str(tmp_path))


def test_a_simulated_engine_speaks_the_models_vocabulary(model_dir, rust):
    tokenizer = load_tokenizer(str(model_dir))
    special = {rust.token_to_id(t) for t in ("<|begin|>", "<|eot|>", "<|start_header|>")}
    assert special.isdisjoint(tokenizer.vocabulary)
    assert tokenizer.eos_token_id == rust.token_to_id("<|eot|>")
    engine = Engine(EngineConfig(num_blocks=64), tokenizer=tokenizer)
    prompt = tokenizer.apply_chat_template(CHAT)
    engine.add_request(EngineRequest("a", prompt, max_tokens=40, ignore_eos=True))
    generated: list[int] = []
    while engine.has_unfinished:
        for output in engine.step().outputs:
            generated += output.new_token_ids
    assert len(generated) == 40 and set(generated) <= set(tokenizer.vocabulary)
    assert isinstance(tokenizer.decode(np.asarray(generated)), str)
