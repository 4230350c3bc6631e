"""The longest prompt the gateway reads follows what its backends serve (their cards:
vLLM's ``max_model_len``, our replicas' KV capacity) unless ``--max-prompt-tokens``
says otherwise: never stricter than the engines, and a prompt no engine could take is
refused at the door."""

import httpx
import pytest

from deploy.processes import running
from tests.shared import wait_until_checked

pytestmark = pytest.mark.slow


def complete(url: str, tokens: int) -> httpx.Response:
    body = {"prompt": [7 + i % 200 for i in range(tokens)], "max_tokens": 1}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=120)


def test_a_prompt_longer_than_131072_tokens_passes_where_the_engines_take_it():
    replica = ["replica", "--speedup", "1000", "--num-blocks", "16384", "--host-blocks", "0"]
    with running(replica) as (backend,), running(["gateway", f"--backend={backend}"]) as (url,):
        wait_until_checked(url)
        answer = complete(url, 200_000)  # refused with 413 when the limit was 131,072
        assert answer.status_code == 200, answer.text[:300]
        assert answer.json()["usage"]["prompt_tokens"] == 200_000


def test_a_prompt_no_engine_could_take_is_refused_by_the_gateway():
    replica = ["replica", "--speedup", "1000", "--num-blocks", "64", "--host-blocks", "0"]
    with running(replica) as (backend,):
        with running(["gateway", f"--backend={backend}"]) as (url,):
            wait_until_checked(url)
            assert complete(url, 500).status_code == 200
            refused = complete(url, 2_000)
            assert refused.status_code == 413
            assert "over the limit of 1024" in refused.json()["error"]["message"]
        flag = ["gateway", f"--backend={backend}", "--max-prompt-tokens", "400"]
        with running(flag) as (url,):  # the flag wins
            wait_until_checked(url)
            assert complete(url, 500).status_code == 413
