"""A fleet that tokenizes as a real model does is routed precisely when the gateway is
given the same tokenizer: the ids it hashes are the ones the engines' events carry."""

import httpx
import pytest

from deploy.processes import running
from tests.shared import build_hf_tokenizer, gateway_stats, wait_until_indexed

pytestmark = pytest.mark.slow

SYSTEM = "You are a helpful assistant for the support desk of a bicycle shop. " * 30


def chat(url: str, question: str) -> httpx.Response:
    body = {
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
        "max_tokens": 4,
    }
    return httpx.post(url + "/v1/chat/completions", json=body, timeout=60)


def test_the_gateway_routes_precisely_with_the_replicas_tokenizer(tmp_path):
    model = str(build_hf_tokenizer(tmp_path / "model"))
    replica = ["replica", "--tokenizer", model, "--num-blocks", "512", "--host-blocks", "0"]
    with running(replica, replica) as replicas:
        backends = [f"--backend={url}" for url in replicas]
        with running(["gateway", "--tokenizer", model, *backends], ["gateway", *backends]) as (
            same,
            simulated,
        ):
            first = chat(same, "How do I true a wheel?")
            assert first.status_code == 200, first.text
            wait_until_indexed(same)
            wait_until_indexed(simulated)
            second = chat(same, "What tension should spokes have?")
            assert (
                second.headers["x-prefix-router-replica"]
                == (first.headers["x-prefix-router-replica"])
            )
            cached = second.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
            predicted = int(second.headers["x-prefix-router-predicted-cached-tokens"])
            assert cached > 200 and cached - 64 < predicted <= cached
            # A gateway hashing other ids than the engines' finds none of their blocks.
            other = chat(simulated, "And the brakes?")
            assert other.status_code == 200
            assert int(other.headers["x-prefix-router-predicted-cached-tokens"]) == 0
            # The second chat's system prompt was tokenized once, by the first.
            pieces = gateway_stats(same).tokenizer_cache
            assert pieces is not None and pieces.hit_tokens > 200 and pieces.bytes > 0
            assert gateway_stats(simulated).tokenizer_cache is None  # bytes4 needs none
