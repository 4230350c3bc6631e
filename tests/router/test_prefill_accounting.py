"""A request's prefill loads its replica until its first generated token, on every path.

One slow replica (chunked prefill of 256 tokens a step, simulated time at a quarter
of real time) behind the gateway: a 4,000-token prompt prefills for about half a
second, then decodes 40 tokens for about a second. Sampling the gateway's view of
the replica while the request runs must show both phases: requests 1 with the prompt
queued as prefill, then requests 1 with no prefill left.
"""

import threading
import time

import httpx
import pytest

from deploy.processes import running
from tests.shared import gateway_stats

pytestmark = pytest.mark.slow

PROMPT = "Every word of this long prompt has to be prefilled first. " * 280  # ~4,000 tokens


@pytest.fixture(scope="module")
def gateway():
    replica = ["replica", "--speedup", "0.25", "--max-num-batched-tokens", "256"]
    with running(replica) as (backend,), running(["gateway", f"--backend={backend}"]) as (url,):
        yield url


def body(chat: bool, stream: bool, salt: str) -> dict:
    shape = {"messages": [{"role": "user", "content": PROMPT}]} if chat else {"prompt": PROMPT}
    # A salt per test: the prompt is never cached, so its whole length is prefilled.
    return {**shape, "max_tokens": 40, "ignore_eos": True, "stream": stream, "cache_salt": salt}


def held_for(samples: list[tuple[float, int, int]], requests: int, prefill: bool) -> float:
    """The longest stretch with ``requests`` in flight and prefill held or not: from
    the first sample that showed it to the first that did not (on a busy machine a
    sample of ``/stats`` can take a tenth of the phase it samples)."""
    longest, start = 0.0, None
    for moment, outstanding, tokens in samples:
        if outstanding == requests and (tokens > 0) == prefill:
            start = moment if start is None else start
        elif start is not None:
            longest, start = max(longest, moment - start), None
    if start is not None:
        longest = max(longest, samples[-1][0] - start)
    return longest


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "whole"])
@pytest.mark.parametrize("chat", [True, False], ids=["chat", "completion"])
def test_prefill_is_released_at_the_first_token_not_before_nor_after(gateway, chat, stream):
    path = "/v1/chat/completions" if chat else "/v1/completions"
    answer: list[httpx.Response] = []
    sender = threading.Thread(
        target=lambda: answer.append(
            httpx.post(gateway + path, json=body(chat, stream, f"{chat}-{stream}"), timeout=60)
        )
    )
    samples = []
    sender.start()
    while sender.is_alive():
        (backend,) = gateway_stats(gateway).backends
        samples.append(
            (time.monotonic(), backend.outstanding_requests, backend.outstanding_prefill_tokens)
        )
    sender.join()
    assert answer[0].status_code == 200
    prefilling, decoding = held_for(samples, 1, True), held_for(samples, 1, False)
    assert prefilling > 0.25, f"prefill released within {prefilling:.3f} s: before its first token"
    assert decoding > 0.5, (
        f"prefill held until {decoding:.3f} s before the end: past its first token"
    )
    (backend,) = gateway_stats(gateway).backends
    assert (backend.outstanding_requests, backend.outstanding_prefill_tokens) == (0, 0)
