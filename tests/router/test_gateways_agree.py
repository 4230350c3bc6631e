"""Several gateways in front of the same replicas route as one: each learns every
replica's cache from its KV events and every replica's load from its reports, whoever
sent the requests."""

import threading

import httpx
import pytest

from deploy.processes import running
from tests.shared import gateway_stats, wait_for, wait_until_indexed

pytestmark = pytest.mark.slow

SLOW_REPLICA = ["replica", "--speedup", "1", "--num-blocks", "512", "--host-blocks", "0"]


def complete(url: str, prompt: list[int], max_tokens: int = 2) -> httpx.Response:
    body = {"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True}
    return httpx.post(url + "/v1/completions", json=body, timeout=120)


def test_a_gateway_predicts_the_cache_another_gateway_filled():
    with running(SLOW_REPLICA, SLOW_REPLICA) as replicas:
        gateway = ["gateway", *[f"--backend={url}" for url in replicas]]
        with running(gateway, gateway) as (first, second):
            prompt = list(range(1, 700))
            filled = complete(first, prompt)
            wait_until_indexed(second)
            answer = complete(second, prompt)
            assert (
                answer.headers["x-prefix-router-replica"]
                == filled.headers["x-prefix-router-replica"]
            )
            cached = answer.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
            assert cached == 688
            predicted = int(answer.headers["x-prefix-router-predicted-cached-tokens"])
            assert cached - 64 < predicted <= cached  # the router keys every 64 tokens


def test_a_gateway_balances_on_load_it_did_not_send():
    with (
        running(SLOW_REPLICA, SLOW_REPLICA) as (busy, idle),
        running(["gateway", f"--backend={busy}", f"--backend={idle}"]) as (gateway,),
    ):
        # Another client (another gateway, say) keeps the first replica busy.
        others = [
            threading.Thread(target=complete, args=(busy, [9000 + i] * 300, 400)) for i in range(6)
        ]
        for thread in others:
            thread.start()

        def seen() -> dict[str, int]:
            return {b.url: b.load_requests for b in gateway_stats(gateway).backends}

        wait_for(lambda: seen()[busy] == 6)
        assert seen()[idle] == 0  # none of them went through this gateway
        assert all(b.outstanding_requests == 0 for b in gateway_stats(gateway).backends)
        chosen = {
            complete(gateway, [i] * 200).headers["x-prefix-router-replica"] for i in range(1, 4)
        }
        assert chosen == {idle}
        for thread in others:
            thread.join()
