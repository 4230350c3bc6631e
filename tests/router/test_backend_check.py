"""A joining backend is checked (block size, tokenizer, a canary prompt's KV events); one
that disagrees with the gateway is routed approximately, with the reason and the flag
that fixes it, never blind. Real replicas and gateways, as subprocesses."""

import time

import httpx
import pytest

from deploy.processes import running
from replica.tiny_model import TinyModelConfig, write_tiny_model
from tests.shared import logged_gateway, replica_stats, wait_until_checked

pytestmark = pytest.mark.slow
PROMPT = "You are a careful assistant. " * 60


def ask(url: str) -> httpx.Response:
    body = {"model": "sim-llama3-8b", "prompt": PROMPT, "max_tokens": 1}
    answer = httpx.post(f"{url}/v1/completions", json=body, timeout=30)
    assert answer.status_code == 200, answer.text
    return answer


def test_a_backend_that_agrees_is_routed_precisely(tmp_path):
    with (
        running(["replica"]) as (replica,),
        logged_gateway(tmp_path / "log", f"--backend={replica}") as url,
    ):
        (backend,) = wait_until_checked(url).backends
        assert (backend.routing_mode, backend.approximate_reason) == ("precise", None)
        assert (backend.engine, backend.model, backend.block_size) == ("sim", "sim-llama3-8b", 16)
        assert backend.unchecked == [] and backend.unkeyed_blocks == 0
        assert replica_stats(replica).requests == 1  # the canary
        ask(url)
        again = ask(url)
        assert int(again.headers["x-prefix-router-predicted-cached-tokens"]) == (
            again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] // 64 * 64
        )
    assert "approximately" not in (tmp_path / "log").read_text()


def test_another_block_size_is_found_routed_approximately_and_named_with_its_flag(tmp_path):
    log = tmp_path / "log"
    with (
        running(["replica"]) as (replica,),
        logged_gateway(log, f"--backend={replica}", "--block-size", "32") as url,
    ):
        (backend,) = wait_until_checked(url).backends
        assert backend.routing_mode == "approximate"
        assert "blocks of 32" in backend.approximate_reason
        assert "--block-size 16" in backend.approximate_reason
        assert replica_stats(replica).requests == 0  # found from its card: no canary needed
        first, second = ask(url), ask(url)  # routed on the gateway's own decisions
        assert first.headers["x-prefix-router-predicted-cached-tokens"] == "0"
        assert int(second.headers["x-prefix-router-predicted-cached-tokens"]) > 0
        metrics = httpx.get(f"{url}/metrics").text
        assert f'prefix_router_backend_precise{{mode="approximate",replica="{replica}"}} 0.0' in (
            metrics
        )
    lines = [line for line in log.read_text().splitlines() if "approximately" in line]
    assert len(lines) == 1 and "--block-size 16" in lines[0]


@pytest.fixture(scope="module")
def tiny_tokenizer(tmp_path_factory):
    config = TinyModelConfig(hidden_size=64, intermediate_size=64, num_layers=1, vocab_size=2000)
    return write_tiny_model(tmp_path_factory.mktemp("tiny"), config)


def test_another_tokenizer_is_found_by_the_engines_own_tokens(tmp_path, tiny_tokenizer):
    flags = (f"--tokenizer={tiny_tokenizer}",)
    with (
        running(["replica"]) as (replica,),
        logged_gateway(tmp_path / "log", f"--backend={replica}", *flags) as url,
    ):
        (backend,) = wait_until_checked(url).backends
        assert backend.routing_mode == "approximate"
        reason = backend.approximate_reason
        assert "tokenizes a canary completion differently" in reason
        assert "--tokenizer bytes4" in reason
    assert "--tokenizer bytes4" in (tmp_path / "log").read_text()


def test_events_the_gateway_cannot_key_are_counted_when_nothing_checks_them(tmp_path):
    flags = ("--block-size", "32", "--no-check-backends")
    with (
        running(["replica"]) as (replica,),
        logged_gateway(tmp_path / "log", f"--backend={replica}", *flags) as url,
    ):
        ask(url)
        for _ in range(100):
            (backend,) = httpx.get(f"{url}/stats").json()["backends"]
            if backend["unkeyed_blocks"]:
                break
            time.sleep(0.05)
        assert backend["unkeyed_blocks"] == len(PROMPT) // 4 // 16  # every block it stored
        assert backend["routing_mode"] == "precise"  # never checked: its events are trusted
        assert backend["unchecked"] == ["every check (--no-check-backends)"]
        metrics = httpx.get(f"{url}/metrics").text
        assert f'prefix_router_unkeyed_event_blocks_total{{replica="{replica}"}}' in metrics
