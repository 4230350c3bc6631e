"""A joining backend is checked (block size, tokenizer, a canary prompt's KV events); one
that disagrees with the gateway is routed approximately, with the reason and the flag
that fixes it, never blind. Real replicas and gateways, as subprocesses."""

import asyncio
import time

import aiohttp
import httpx
import pytest

from deploy.processes import running
from replica.tiny_model import TinyModelConfig, write_tiny_model
from router.config import GatewayConfig
from router.gateway import Gateway
from tests.shared import (
    CHAT_TEMPLATE,
    awaited,
    build_hf_tokenizer,
    logged_gateway,
    replica_stats,
    wait_until_checked,
)

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


def test_another_chat_template_is_found_by_the_canary_conversation(tmp_path):
    """The same tokenizer, another chat template: the canary completion agrees, the
    canary conversation does not, and the reason says which."""
    model = str(build_hf_tokenizer(tmp_path / "model"))
    other = tmp_path / "other.jinja"
    other.write_text(
        "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}[assistant] {% endif %}"
    )
    flags = (f"--tokenizer={model}", f"--chat-template={other}")
    with (
        running(["replica", "--tokenizer", model]) as (replica,),
        logged_gateway(tmp_path / "log", f"--backend={replica}", *flags) as url,
    ):
        (backend,) = wait_until_checked(url).backends
    assert backend.routing_mode == "approximate"
    assert "tokenizes a canary chat differently" in (backend.approximate_reason or "")
    assert "completion" not in (backend.approximate_reason or "")


def test_a_gateway_that_renders_tools_otherwise_is_found_by_the_canary_with_a_tool(tmp_path):
    """The same tokenizer and turns, but the engine's template renders a request's tools
    and the gateway's does not: the canary completion and conversation agree, the
    conversation with a tool and a template argument does not, and the reason says so."""
    model = str(build_hf_tokenizer(tmp_path / "model"))
    with_tools = tmp_path / "tools.jinja"
    with_tools.write_text("{% if tools %}{{ tools | tojson }}{% endif %}" + CHAT_TEMPLATE)
    with (
        running(["replica", "--tokenizer", model, "--chat-template", str(with_tools)]) as (
            replica,
        ),
        logged_gateway(tmp_path / "log", f"--backend={replica}", f"--tokenizer={model}") as url,
    ):
        (backend,) = wait_until_checked(url).backends
    assert backend.routing_mode == "approximate"
    reason = backend.approximate_reason or ""
    assert "tokenizes a canary chat with a tool and a template argument differently" in reason
    assert "--chat-template" in reason


def test_a_backend_is_routed_approximately_until_its_check_passes():
    """Its events are believed only once the check shows they key as the router's
    identities: a prompt the replica cached meanwhile is unknown to the index while the
    check runs (held here, the real check delayed), and read from its replay socket
    once it passes."""
    asyncio.run(_checked_late())


async def _checked_late() -> None:
    with running(["replica"]) as (replica,):
        async with aiohttp.ClientSession() as client:
            gateway = Gateway(GatewayConfig(), client)
            pool, release = gateway.pool, asyncio.Event()
            assert pool.check is not None
            real_check = pool.check.check

            async def held(*args, **kwargs):
                await release.wait()
                return await real_check(*args, **kwargs)

            pool.check.check = held  # type: ignore[method-assign]
            try:
                (backend,) = [pool.add(replica)]
                direct = {"prompt": PROMPT, "max_tokens": 1}
                async with client.post(f"{replica}/v1/completions", json=direct) as answer:
                    assert answer.status == 200
                batches = replica_stats(replica).kv_event_batches
                await awaited(lambda: indexed_through(backend) >= batches)
                assert backend.routing_mode == "checking" and not backend.state.precise
                keys = gateway.resolver.keyed(gateway.tokenizers.default.encode(PROMPT), None)
                index = gateway.models.policy().prefix_index()
                assert index is not None and index.match(keys.stride_hashes) == {}
                release.set()
                await awaited(lambda: backend.routing_mode == "precise")
                assert backend.state.precise and backend.unchecked == ()
                held_tokens = len(keys.stride_hashes) * GatewayConfig().routing.stride_tokens
                await awaited(lambda: index.match(keys.stride_hashes).get(replica) == held_tokens)
            finally:
                await pool.close()


def test_an_interrupted_check_is_tried_again_while_the_backend_stays_up():
    """A check cut short (a timeout) while the backend answers its health probes gives a
    verdict on its next try, a second later (before, it stayed ``checking`` for ever)."""
    asyncio.run(_interrupted_once())


async def _interrupted_once() -> None:
    with running(["replica"]) as (replica,):
        async with aiohttp.ClientSession() as client:
            pool = Gateway(GatewayConfig(), client).pool
            assert pool.check is not None
            real_check, tries = pool.check.check, []

            async def timing_out_once(*args, **kwargs):
                tries.append(time.monotonic())
                if len(tries) == 1:
                    raise TimeoutError("the canary's answer took too long")
                return await real_check(*args, **kwargs)

            pool.check.check = timing_out_once  # type: ignore[method-assign]
            try:
                backend = pool.add(replica)
                await awaited(lambda: backend.routing_mode == "precise")
                assert len(tries) == 2 and tries[1] - tries[0] >= 1.0 and backend.healthy
            finally:
                await pool.close()


def test_a_block_size_the_engine_does_not_say_is_said_to_be_unchecked():
    """An engine whose card says no block size (told nothing of it here): the check says
    so rather than passing it in silence; its events' blocks are still checked."""
    asyncio.run(_unsaid_block_size())


async def _unsaid_block_size() -> None:
    with running(["replica"]) as (replica,):
        async with aiohttp.ClientSession() as client:
            check = Gateway(GatewayConfig(), client).pool.check
            assert check is not None
            check.events_timeout_s = 0.5  # no events are fed to it here: quick to fail
            verdict = await check.check(replica, None, lambda watch: None, lambda: None)
            assert verdict.skipped[0].startswith("block size (the engine does not say it")
            assert not verdict.precise and "canary" in (verdict.reason or "")


def indexed_through(backend) -> int:
    """The batch after the last of the backend's events in the index (0: none)."""
    stream = backend.stream
    return (stream.indexed_through or 0) if stream is not None else 0
