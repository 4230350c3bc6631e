"""vLLM's ``kv_transfer_params`` protocol between real replica processes: a prefill
held for its decode replica, a peer's prefix pulled, a peer that cannot lend."""

import httpx
import pytest

from deploy.processes import running
from replica.api.kv_params import pull_params
from tests.shared import replica_stats

pytestmark = pytest.mark.slow

BLOCK = 16


def document(tag: str) -> str:
    """A long prompt of its own (bytes4: about 2,000 tokens), shared with no other test."""
    return " ".join(f"{tag}{i}" for i in range(1200))


@pytest.fixture(scope="module")
def replicas():
    flags = ["--speedup", "20", "--num-blocks", "2048"]
    with running(["replica", *flags, "--role", "prefill"], ["replica", *flags]) as urls:
        yield urls


def complete(url: str, **body) -> dict:
    body = {"max_tokens": 4, "ignore_eos": True, **body}
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=30)
    assert response.status_code == 200, response.text
    return response.json()


def test_a_prefill_for_a_remote_decode_is_pulled_by_the_decode_replica(replicas):
    prefill, decode = replicas
    before = replica_stats(decode).transfers
    first = complete(
        prefill,
        prompt=document("one"),
        max_tokens=1,
        kv_transfer_params={"do_remote_decode": True},
    )
    params = first["kv_transfer_params"]
    assert params["do_remote_prefill"] and params["remote_request_id"] == first["id"]
    assert f"http://{params['remote_host']}:{params['remote_port']}" == prefill
    answer = complete(decode, prompt=document("one"), kv_transfer_params=params)
    prompt_tokens = answer["usage"]["prompt_tokens"]
    cached = answer["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached == (prompt_tokens - 1) // BLOCK * BLOCK  # all but the last token, pulled
    after = replica_stats(decode).transfers
    assert after.pulls == before.pulls + 1 and after.pull_fallbacks == before.pull_fallbacks
    assert after.pulled_tokens - before.pulled_tokens == cached
    lender = replica_stats(prefill)
    assert lender.config.role == "prefill" and lender.transfers.lent_blocks >= cached // BLOCK


def test_a_replica_pulls_the_prefix_a_peer_holds_instead_of_computing_it(replicas):
    peer, puller = replicas
    complete(peer, prompt=document("two"))
    before = replica_stats(puller).transfers
    answer = complete(puller, prompt=document("two"), kv_transfer_params=pull_params(peer, 1024))
    assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == 1024
    after = replica_stats(puller).transfers
    assert after.pulls == before.pulls + 1 and after.pulled_tokens - before.pulled_tokens == 1024


def test_a_peer_that_cannot_lend_leaves_the_replica_to_compute_the_prompt(replicas):
    peer, puller = replicas
    before = replica_stats(puller).transfers
    fresh = document("three")  # the peer never saw it
    answer = complete(puller, prompt=fresh, kv_transfer_params=pull_params(peer, 512))
    assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    gone = complete(
        puller, prompt=document("four"), kv_transfer_params=pull_params("http://127.0.0.1:9", 512)
    )
    assert gone["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    after = replica_stats(puller).transfers
    assert after.pull_fallbacks == before.pull_fallbacks + 2 and after.pulls == before.pulls


def test_a_remote_decode_takes_a_whole_answer_and_one_prompt(replicas):
    prefill, _ = replicas
    body = {"prompt": "hi", "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}
    streamed = httpx.post(f"{prefill}/v1/completions", json={**body, "stream": True}, timeout=30)
    assert streamed.status_code == 400 and "stream" in streamed.text
    several = httpx.post(f"{prefill}/v1/completions", json={**body, "n": 2}, timeout=30)
    assert several.status_code == 400
