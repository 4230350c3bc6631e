"""A fleet of two models with two tokenizers is routed precisely for both: each model's
requests are tokenized with its own tokenizer, learned from its replicas' cards or named
per model (real processes)."""

import asyncio
from pathlib import Path

import httpx
import pytest

from deploy.processes import running
from replica.api.tokenizer import ByteTokenizer, Tokenizer
from router.config import GatewayConfig
from router.fleet.tokenizers import ModelTokenizers
from tests.shared import build_hf_tokenizer, wait_until_checked, wait_until_indexed

SYSTEM = "You are a helpful assistant for the support desk of a bicycle shop. " * 30


def chat(url: str, model: str, question: str) -> httpx.Response:
    body = {
        "model": model,
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
        "max_tokens": 4,
    }
    answer = httpx.post(url + "/v1/chat/completions", json=body, timeout=60)
    assert answer.status_code == 200, answer.text
    return answer


def routed_precisely(url: str, model: str) -> None:
    """A model's second chat of one system prompt goes where the first went, predicted
    within a stride of what its engine found cached."""
    first = chat(url, model, "How do I true a wheel?")
    wait_until_indexed(url)
    second = chat(url, model, "What tension should spokes have?")
    assert second.headers["x-prefix-router-replica"] == first.headers["x-prefix-router-replica"]
    cached = second.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    predicted = int(second.headers["x-prefix-router-predicted-cached-tokens"])
    assert cached > 200 and cached - 64 < predicted <= cached, (model, cached, predicted)


@pytest.mark.slow
def test_two_models_with_two_tokenizers_are_each_routed_precisely(tmp_path: Path):
    llama = str(build_hf_tokenizer(tmp_path / "llama", vocab_size=400))
    qwen = str(build_hf_tokenizer(tmp_path / "qwen", vocab_size=300))  # other ids
    small = ["--num-blocks", "512", "--host-blocks", "0", "--speedup", "20"]
    replicas = [
        ["replica", "--model", model, "--tokenizer", tokenizer, *small]
        for model, tokenizer in [("llama", llama), ("llama", llama), ("qwen", qwen), ("qwen", qwen)]
    ]
    with running(*replicas) as urls:
        backends = [f"--backend={url}" for url in urls]
        gateway = ["gateway", "--model", "llama", "--tokenizer", llama, *backends]
        # the same gateway told a wrong tokenizer for qwen: the named one is believed
        told_wrong = [*gateway, "--model-tokenizer", f"qwen={llama}"]
        with running(gateway, told_wrong) as (learned, wrong):
            # qwen's tokenizer learned from its replicas' cards: every replica checked
            # precise (with one tokenizer for the gateway, qwen's failed the canary)
            modes = {b.url: b.routing_mode for b in wait_until_checked(learned, 4).backends}
            assert modes == dict.fromkeys(urls, "precise")
            routed_precisely(learned, "llama")
            routed_precisely(learned, "qwen")

            told = {b.url: b for b in wait_until_checked(wrong, 4).backends}
            assert [told[url].routing_mode for url in urls] == ["precise"] * 2 + ["approximate"] * 2
            reason = told[urls[2]].approximate_reason or ""
            assert "canary" in reason and f"--model-tokenizer qwen={qwen}" in reason, reason


def test_a_model_has_the_named_tokenizer_else_its_cards_else_the_gateways(tmp_path: Path):
    loads: list[str] = []

    def load(name: str) -> Tokenizer:
        loads.append(name)
        if name == "elsewhere":
            raise ValueError("unknown tokenizer 'elsewhere'")
        return ByteTokenizer()

    own = ByteTokenizer()
    tokenizers = ModelTokenizers(own, "bytes4", "llama", {"mistral": "m"}, load)
    assert loads == ["m"] and tokenizers.several  # the named one, loaded at start
    mistral = tokenizers.of("mistral")

    async def learned() -> list[Tokenizer]:
        return await asyncio.gather(
            tokenizers.learn("qwen", "q"),
            tokenizers.learn("qwen", "q"),  # two replicas joining at once: one load
            tokenizers.learn("llama", "q"),  # the gateway's model keeps the gateway's
            tokenizers.learn("mistral", "q"),  # the operator's word over a card's
            tokenizers.learn("phi", "elsewhere"),  # not readable here: the gateway's
            tokenizers.learn("gemma", None),  # a card that names none
        )

    qwen, again, llama, named, phi, gemma = asyncio.run(learned())
    assert loads == ["m", "q", "elsewhere"]
    assert qwen is again is tokenizers.of("qwen") and qwen is not own and qwen is not mistral
    assert llama is own and named is mistral and phi is own and gemma is own
    assert tokenizers.of("phi") is own and tokenizers.of(None) is own


def test_a_malformed_model_tokenizer_is_refused_at_start():
    config = GatewayConfig(model_tokenizer=("qwen=/models/qwen", "a=b"))
    assert config.named_tokenizers() == {"qwen": "/models/qwen", "a": "b"}
    with pytest.raises(ValueError, match="--model-tokenizer 'qwen': give MODEL=TOKENIZER"):
        GatewayConfig(model_tokenizer=("qwen",))
