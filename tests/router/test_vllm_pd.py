"""A 1P1D fleet of real vLLM servers (its CPU build, the tiny model) through the
gateway: prefilled on one, decoded on the other, the KV moved by vLLM's own
ExampleConnector (files on a shared path: no GPU calls), and the decode server's
greedy answer the one a server that computed the prompt itself gives."""

import json

import httpx
import numpy as np
import pytest

from replica.api.tokenizer import WORDS
from tests.shared import VLLM_ARGS, logged_gateway, vllm_backend, vllm_servers, wait_until_checked

pytestmark = [pytest.mark.slow, pytest.mark.vllm]
SYLLABLES = [int(w).to_bytes(4, "little").decode() for w in WORDS]


def text(seed: int, words: int = 1500) -> str:
    """Words the tiny model's tokenizer holds whole: about one token each."""
    rng = np.random.default_rng(seed)
    return "".join(SYLLABLES[i] for i in rng.integers(0, len(SYLLABLES), words))


def complete(url: str, model: str, prompt: str) -> httpx.Response:
    body = {"model": model, "prompt": prompt, "max_tokens": 12, "temperature": 0, "logprobs": 1}
    answer = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    assert answer.status_code == 200, answer.text
    return answer


def test_a_1p1d_vllm_fleet_moves_the_kv_through_its_connector(tiny_model, tmp_path):
    connector = {
        "kv_connector": "ExampleConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"shared_storage_path": str(tmp_path / "kv")},
    }
    engine = (*VLLM_ARGS, "--kv-transfer-config", json.dumps(connector))
    model = str(tiny_model)
    with vllm_servers(tiny_model, 2, engine) as (prefill, decode):
        backends = [
            f"--backend={vllm_backend(prefill)},role=prefill",
            f"--backend={vllm_backend(decode)},role=decode",
        ]
        flags = ("--model", model, "--tokenizer", model, "--block-size", "32")
        with logged_gateway(
            tmp_path / "gateway.log", *backends, *flags, "--policy", "pd_always"
        ) as url:
            stats = wait_until_checked(url, 2)
            assert sorted(b.role for b in stats.backends) == ["decode", "prefill"]
            prompt = text(11)
            answer = complete(url, model, prompt)
            assert answer.headers["x-prefix-router-prefill"] == prefill.url
            assert answer.headers["x-prefix-router-replica"] == decode.url
            usage = answer.json()["usage"]
            # the connector's load, reported as cached: every full block but the last token's
            assert usage["prompt_tokens_details"]["cached_tokens"] >= 1440
            # the prefill server computed the prompt itself (and caches it): the same answer,
            # to the last bit of every log-probability (the tiny model's text repeats a word)
            itself = complete(prefill.url, model, prompt).json()["choices"][0]
            decoded = answer.json()["choices"][0]
            assert decoded["text"] == itself["text"]
            assert decoded["logprobs"]["token_logprobs"] == itself["logprobs"]["token_logprobs"]
            assert httpx.get(f"{url}/stats").json()["paths"] == {"disaggregated": 1}
