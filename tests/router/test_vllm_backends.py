"""The gateway in front of real vLLM servers (vLLM's CPU build serving the tiny model):
precise routing from vLLM's own KV events, each mismatch found and routed around, an
evicted prefix no longer predicted, a late gateway learning vLLM's cache from its
replay socket, a LoRA adapter's blocks, which vLLM salts with its name, and, last, a
crash of the servers that leaves nothing of them behind."""

import os
import re
import shlex
import signal
import socket
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager
from pathlib import Path

import httpx
import numpy as np
import psutil
import pytest

from replica.api.chat_variables import tokenize_variables
from replica.api.cost_model import get_profile
from replica.api.model_tokenizer import load_tokenizer
from replica.api.tokenizer import WORDS
from replica.tiny_model import write_tiny_lora
from replica.vllm_server import remove_orphaned_folders
from router.path.envelope import request_prompts
from tests.shared import (
    VLLM_ARGS,
    logged_gateway,
    prefix_router,
    vllm_backend,
    vllm_servers,
    wait_for,
    wait_until_checked,
)

pytestmark = [pytest.mark.slow, pytest.mark.vllm]
SYLLABLES = [int(w).to_bytes(4, "little").decode() for w in WORDS]


def text(seed: int, words: int = 1500) -> str:
    """Words the tiny model's tokenizer holds whole: about one token each."""
    rng = np.random.default_rng(seed)
    return "".join(SYLLABLES[i] for i in rng.integers(0, len(SYLLABLES), words))


@pytest.fixture(scope="module")
def servers(tiny_model, tmp_path_factory):
    """Two servers of the tiny model, with a LoRA adapter of it, ``sql``, made here."""
    adapter = write_tiny_lora(tmp_path_factory.mktemp("sql"), tiny_model)
    lora = ("--enable-lora", "--lora-modules", f"sql={adapter}", "--max-lora-rank", "8")
    with vllm_servers(tiny_model, 2, VLLM_ARGS + lora) as started:
        yield started


@pytest.fixture
def fresh(servers):
    """Both servers with empty prefix caches."""
    for server in servers:
        assert httpx.post(f"{server.url}/reset_prefix_cache").status_code == 200
    return servers


def gateway(log: Path, backends: list[str], *flags: str) -> AbstractContextManager[str]:
    """A gateway in front of ``backends`` (its log to ``log``)."""
    return logged_gateway(log, *(f"--backend={b}" for b in backends), *flags)


def matching(model: Path, *more: str) -> tuple[str, ...]:
    """The flags that make a gateway hash as these servers cache."""
    return ("--model", str(model), "--tokenizer", str(model), "--block-size", "32", *more)


def complete(url: str, model: Path | str, prompt: str) -> httpx.Response:
    body = {"model": str(model), "prompt": prompt, "max_tokens": 1}
    answer = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    assert answer.status_code == 200, answer.text
    return answer


def cached(answer: httpx.Response) -> int:
    return int(answer.json()["usage"]["prompt_tokens_details"]["cached_tokens"])


def predicted(answer: httpx.Response) -> int:
    return int(answer.headers["x-prefix-router-predicted-cached-tokens"])


def test_a_prefix_warmed_on_one_server_is_routed_there_and_predicted_exactly(
    fresh, tiny_model, tmp_path
):
    backends = [vllm_backend(s) for s in fresh]
    with gateway(tmp_path / "log", backends, *matching(tiny_model, "--stride", "1")) as url:
        stats = wait_until_checked(url, 2)
        assert [b.routing_mode for b in stats.backends] == ["precise", "precise"]
        assert {(b.engine, b.block_size) for b in stats.backends} == {("vllm", 32)}
        warmed = fresh[1]
        assert cached(complete(warmed.url, tiny_model, text(1))) == 0
        for suffix in ("bal kes", "dit mon"):
            answer = complete(url, tiny_model, text(1) + suffix)
            assert answer.headers["x-prefix-router-replica"] == warmed.url
            assert predicted(answer) == cached(answer) >= 1472  # vLLM's own figure, exactly
        chat = [{"role": "system", "content": text(2)}, {"role": "user", "content": "bal"}]
        body = {"model": str(tiny_model), "messages": chat, "max_tokens": 1}
        first = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)
        chat.append({"role": "user", "content": "kes"})  # the next turn: the template agrees
        second = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)
        assert predicted(second) == cached(second) > 1400 and predicted(first) == 0
        (stats,) = [httpx.get(f"{url}/stats").json()]
        counts = [c for b in stats["backends"] for c in b["by_policy"].values()]
        assert sum(c["exact_predictions"] for c in counts) == sum(c["predictions"] for c in counts)


def test_a_chat_with_tools_and_template_arguments_is_tokenized_as_vllm_renders_it(
    servers, tiny_model
):
    """The gateway gives the chat template what vLLM gives it beside the messages (the
    tools as vLLM dumps them, non-ASCII as is; ``chat_template_kwargs``; the
    ``enable_thinking`` a ``reasoning_effort`` sets): its tokens are vLLM's own, for a
    chat completion and for ``/tokenize``. The tiny model's template renders both."""
    tokenizer, url = load_tokenizer(str(tiny_model)), servers[0].url
    tools = [
        {"function": {"parameters": {"type": "object"}, "name": "météo", "x": 1}},
        {"type": "function", "function": {"name": "f", "description": "<b>東京</b>", "strict": 1}},
    ]
    chat = [{"role": "system", "content": "bal kes"}, {"role": "user", "content": "dit mon"}]
    plain = request_prompts({"messages": chat}, True, tokenizer)[0].tolist()
    for extra in (
        {"tools": tools, "chat_template_kwargs": {"enable_thinking": False}},
        {
            "tools": tools[:1],
            "reasoning_effort": "none",
            "documents": [{"title": "a", "text": "b"}],
        },
    ):
        body = {"model": str(tiny_model), "messages": chat, "tool_choice": "none", **extra}
        ours = request_prompts(body, True, tokenizer)[0].tolist()
        assert len(ours) > len(plain) + 20  # the tools and the empty thinking rendered
        answer = httpx.post(
            f"{url}/v1/chat/completions",
            json={**body, "max_tokens": 1, "return_token_ids": True},
            timeout=60,
        )
        assert answer.status_code == 200, answer.text
        assert answer.json()["prompt_token_ids"] == ours
    body = {"model": str(tiny_model), "messages": chat, "tools": tools}
    body["chat_template_kwargs"] = {"enable_thinking": False}
    ours = tokenizer.apply_chat_template(chat, variables=tokenize_variables(body)).tolist()
    assert httpx.post(f"{url}/tokenize", json=body, timeout=60).json()["tokens"] == ours


def test_an_adapters_blocks_are_keyed_by_its_name_and_predicted_exactly(
    fresh, tiny_model, tmp_path
):
    """vLLM salts a LoRA request's block hashes with the adapter's name and says it in
    ``BlockStored.lora_name``: the gateway keys those blocks as it hashes the adapter's
    prompts, and routes the adapter only to servers that list it."""
    backends = [vllm_backend(s) for s in fresh]
    with gateway(tmp_path / "log", backends, *matching(tiny_model, "--stride", "1")) as url:
        wait_until_checked(url, 2)
        listed = httpx.get(f"{url}/v1/models").json()["data"]
        models = [(m["id"], m["parent"]) for m in listed]
        assert models == [(str(tiny_model), None), ("sql", str(tiny_model))]
        first = complete(url, "sql", text(6))
        again = complete(url, "sql", text(6) + "bal")
        base = complete(url, tiny_model, text(6) + "kes")  # the same text, no adapter
        assert first.json()["model"] == "sql" and predicted(first) == cached(first) == 0
        assert again.headers["x-prefix-router-replica"] == first.headers["x-prefix-router-replica"]
        assert predicted(again) == cached(again) >= 1472
        assert predicted(base) == cached(base) == 0  # the adapter's blocks are its own
        models = httpx.get(f"{url}/stats").json()["models"]
        assert models["sql"]["requests"] == 2 and models[str(tiny_model)]["requests"] == 1


def test_a_gateway_that_hashes_blocks_of_16_is_told_vllms_are_32(fresh, tiny_model, tmp_path):
    log = tmp_path / "log"
    flags = ("--model", str(tiny_model), "--tokenizer", str(tiny_model))  # block size: default
    with gateway(log, [vllm_backend(s) for s in fresh], *flags) as url:
        stats = wait_until_checked(url, 2)
        assert [b.routing_mode for b in stats.backends] == ["approximate"] * 2
        assert all("--block-size 32" in b.approximate_reason for b in stats.backends)
        prompt = text(3)
        first = complete(url, tiny_model, prompt)
        second = complete(url, tiny_model, prompt + "bal")  # routed from its own decision
        assert second.headers["x-prefix-router-replica"] == first.headers["x-prefix-router-replica"]
        assert cached(second) >= 1472
    lines = [line for line in log.read_text().splitlines() if "routed approximately" in line]
    assert len(lines) == 2 and all("start the gateway with --block-size 32" in x for x in lines)


def test_a_gateway_with_another_tokenizer_is_told_the_models(fresh, tiny_model, tmp_path):
    flags = ("--model", str(tiny_model), "--block-size", "32")  # tokenizer: bytes4
    with gateway(tmp_path / "log", [vllm_backend(fresh[0])], *flags) as url:
        (backend,) = wait_until_checked(url).backends
        assert backend.routing_mode == "approximate"
        assert "tokenizes a canary completion differently" in backend.approximate_reason
        assert f"--tokenizer {tiny_model}" in backend.approximate_reason


def test_swapped_event_endpoints_are_found_by_the_canary(fresh, tiny_model, tmp_path):
    """Each server named with the other's KV events: its canary's blocks never come."""
    (a_url, a_events), (b_url, b_events) = [vllm_backend(s).split(",", 1) for s in fresh]
    swapped = [f"{a_url},{b_events}", f"{b_url},{a_events}"]
    with gateway(tmp_path / "log", swapped, *matching(tiny_model)) as url:
        stats = wait_until_checked(url, 2, timeout_s=60)
        assert [s.routing_mode for s in stats.backends] == ["approximate"] * 2
        for backend in stats.backends:  # each saw the other's canary, never its own
            assert "key to other identities" in backend.approximate_reason
            assert "check the backend's kv= endpoint" in backend.approximate_reason


def test_a_server_named_without_its_events_is_routed_approximately(fresh, tiny_model, tmp_path):
    with gateway(tmp_path / "log", [fresh[0].url], *matching(tiny_model)) as url:
        (backend,) = wait_until_checked(url).backends
        assert backend.routing_mode == "approximate"
        assert "publishes no KV events" in backend.approximate_reason


def test_a_prefix_vllm_evicted_is_no_longer_predicted(fresh, tiny_model, tmp_path):
    """Its BlockRemoved events outrank the gateway's own recent decision to send it there."""
    backends = [vllm_backend(s) for s in fresh]
    with gateway(tmp_path / "log", backends, *matching(tiny_model, "--stride", "1")) as url:
        wait_until_checked(url, 2)
        warm = complete(url, tiny_model, text(4))
        holder = warm.headers["x-prefix-router-replica"]
        for seed in range(10, 17):  # 10,500 new tokens straight to it: its 7,808 turn over
            complete(holder, tiny_model, text(seed))
        again = complete(url, tiny_model, text(4) + "bal")  # within recent_s (5 s) of the warm
        assert predicted(again) == cached(again)
        assert cached(again) == 0  # evicted everywhere: both predict and find nothing


def test_a_gateway_that_joins_late_learns_vllms_cache_from_its_replay_socket(
    fresh, tiny_model, tmp_path
):
    held = fresh[0]
    complete(held.url, tiny_model, text(5))  # before any gateway exists
    backends = [vllm_backend(s) for s in fresh]
    with gateway(tmp_path / "log", backends, *matching(tiny_model, "--stride", "1")) as url:
        wait_until_checked(url, 2)
        answer = complete(url, tiny_model, text(5) + "bal")
        assert answer.headers["x-prefix-router-replica"] == held.url
        assert predicted(answer) == cached(answer) >= 1472
        backends = httpx.get(f"{url}/stats").json()["backends"]
        stream = next(b["kv_stream"] for b in backends if b["url"] == held.url)
        assert stream["replayed"] > 0


def test_a_server_restarted_on_its_ports_is_forgotten_then_learned_from_its_new_events(
    fresh, tiny_model, tmp_path
):
    """A restarted vLLM numbers its KV event batches from 0 again on the same socket: the
    gateway drops what the old engine held (no prediction of it), checks the server
    again, and believes the new engine's events (a prefix warmed straight on it is
    predicted exactly, which only its events can tell)."""
    restarted = fresh[0]
    backends = [vllm_backend(s) for s in fresh]
    with gateway(tmp_path / "log", backends, *matching(tiny_model, "--stride", "1")) as url:
        wait_until_checked(url, 2)
        complete(restarted.url, tiny_model, text(6))
        for _ in range(8):  # more batches than the new engine will have published
            complete(restarted.url, tiny_model, text(6) + "bal")
        warm = complete(url, tiny_model, text(6) + "kes")
        assert warm.headers["x-prefix-router-replica"] == restarted.url
        assert predicted(warm) == cached(warm) >= 1472
        before = stream_of(url, restarted.url)["indexed_through"]
        restarted.stop()
        restarted.launch()
        restarted.wait_ready()
        complete(restarted.url, tiny_model, text(8))  # the new engine's first batch

        def followed_anew() -> bool:  # the new engine's batches indexed, numbered anew
            return 0 < (stream_of(url, restarted.url)["indexed_through"] or 0) < before

        wait_for(followed_anew, 30, "the new engine's batches in the index")
        assert stream_of(url, restarted.url)["restarts"] == 1
        wait_until_checked(url, 2)  # checked again, as a new backend
        old = complete(url, tiny_model, text(6) + "dit")
        assert predicted(old) == cached(old) == 0  # the old engine's cache went with it
        new = complete(url, tiny_model, text(8) + "mon")
        assert new.headers["x-prefix-router-replica"] == restarted.url
        assert predicted(new) == cached(new) >= 1472


def test_a_servers_own_queue_is_read_from_its_metrics(fresh, tiny_model, tmp_path):
    """vLLM pushes no load: the gateway reads its ``/metrics`` gauges. Requests sent
    straight to one server, which the gateway never saw, count in that server's load,
    and a new prompt goes to the other."""
    busy, idle = fresh
    backends = [vllm_backend(s) for s in fresh]
    with gateway(tmp_path / "log", backends, *matching(tiny_model, "--stride", "1")) as url:
        wait_until_checked(url, 2)
        body = {"model": str(tiny_model), "max_tokens": 400, "ignore_eos": True}
        with ThreadPoolExecutor(6) as pool:
            straight = [
                pool.submit(
                    httpx.post,
                    f"{busy.url}/v1/completions",
                    timeout=120,
                    json={**body, "prompt": text(20 + i, 200)},
                )
                for i in range(6)
            ]

            def load_of(server: str) -> int:
                stats = httpx.get(f"{url}/stats").json()["backends"]
                return next(b["load_requests"] for b in stats if b["url"] == server)

            wait_for(lambda: load_of(busy.url) >= 4, 30, "the busy server's own queue read")
            assert load_of(idle.url) == 0
            answer = complete(url, tiny_model, text(9))
            assert answer.headers["x-prefix-router-replica"] == idle.url
            assert all(f.result().status_code == 200 for f in straight)


def stream_of(gateway: str, backend: str) -> dict:
    backends = httpx.get(f"{gateway}/stats").json()["backends"]
    return next(b["kv_stream"] for b in backends if b["url"] == backend)


def test_calibrate_fits_a_vllm_server_and_reads_its_kv_pool(fresh, tmp_path):
    """`prefix-router calibrate` against vLLM: a short sweep fits its times, and the
    profile holds vLLM's own pool (256 blocks of 32 tokens in 16 MB: 2 KB a token)."""
    out = tmp_path / "calibrated"
    sweep = shlex.split(
        "--prompt-lengths 256,1024,2048 --cached-fractions 0,0.5 --batch-sizes 1,2,4"
        " --decode-contexts 128,512 --decode-tokens 16 --repeats 2"
    )
    done = prefix_router(
        "calibrate", "--backend", fresh[0].url, *sweep, "--no-progress", "--out", str(out)
    )
    assert done.returncode == 0, done.stderr[-3000:]
    profile = get_profile(str(out / "profile.json"))
    assert (profile.kv_tokens, profile.kv_bytes_per_token) == (8192, 2048)
    # A short sweep on a shared machine pins the sums down better than the split
    # between terms (request against step overheads, linear against attention).
    assert profile.costs.step_s > 0 and profile.costs.token_s > 0
    median = float(re.search(r"median ([\d.]+)%", done.stdout).group(1))
    assert median < 10, done.stdout


def test_a_crashed_api_server_or_guard_takes_the_whole_server_with_it(servers):
    """vLLM is several processes: killing one server's API server, as the kernel's OOM
    killer would, leaves no engine core holding its ports; killing another's guard
    outright, as Ray kills a killed actor's children, ends that server too, and the next
    server started sweeps the folder it left. Last in this module: it ends the module's
    servers (a vLLM server takes most of a minute to start)."""
    first, second = servers
    guard = psutil.Process(first.process.pid)
    group = guard.children(recursive=True)
    cores = list(first.config.cpus) or list(os.sched_getaffinity(0))
    assert len(group) >= 2 and all(p.cpu_affinity() == cores for p in [guard, *group])
    (api,) = guard.children()
    os.kill(api.pid, signal.SIGKILL)
    _, alive = psutil.wait_procs([guard, *group], timeout=20)
    assert not alive, f"left running: {alive}"
    for port in (first.ports.http, first.ports.kv_events, first.ports.replay):
        with socket.socket() as probe:  # nothing of the server holds its ports
            # as a restarted server binds: past the connections the kill left in
            # TIME_WAIT (this module's gateways talked to it), never past a listener
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind(("127.0.0.1", port))
    folder = first.workdir
    first.stop()  # a dead server's stop still removes its folder
    assert first.workdir is None and folder is not None and not folder.exists()

    guard = psutil.Process(second.process.pid)
    group = guard.children(recursive=True)
    os.kill(guard.pid, signal.SIGKILL)
    _, alive = psutil.wait_procs(group, timeout=30)
    assert not alive, f"outlived their guard: {alive}"
    second.process.wait()  # reaped, as init reaps it once its owner is gone too
    orphaned, second.workdir = second.workdir, None
    assert orphaned.exists()
    remove_orphaned_folders()  # what every server's launch does first
    assert not orphaned.exists()
