"""Helpers and data the tests share (fixtures are in conftest.py)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path

import httpx
import numpy as np
import psutil
from aiohttp import web

from deploy import processes
from deploy.processes import free_port
from replica.api import stats as stats_codec
from replica.api.fleet_token import bearer
from replica.api.stats import ReplicaStats
from replica.api.tokenizer import TOKEN_DTYPE
from replica.vllm_server import WORK_PREFIX, Ports, VLLMConfig, VLLMServer, cores_of
from router.stats import GatewayStats

#: The first 400 requests of ../shared/traces/mooncake_conversation.jsonl (see data/README.md).
MOONCAKE_TRACE = Path(__file__).resolve().parent / "data" / "mooncake_conversation_head.jsonl"


class FakeClock:
    """A clock the test moves by hand: ``clock.now += 5``."""

    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


class Colliding:
    """A block hasher whose identity is the block's index: every prompt collides with
    every other (for tests that a collision costs a miss, never a wrong answer)."""

    def __init__(self, block_size: int, seed: int) -> None:
        self.block_size, self.count = block_size, 0

    def extend_bytes(self, data: bytes) -> list[int]:
        self.count += len(data) // 4
        return list(range(self.count // self.block_size))

    def hold(self, data: bytes) -> None:
        self.count += len(data) // 4


@contextlib.asynccontextmanager
async def http_server(
    path: str, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> AsyncIterator[str]:
    """A real HTTP server on loopback that answers POSTs to ``path`` with ``handler``
    (a server that misbehaves as the test needs): its URL, stopped however the block
    ends."""
    app = web.Application()
    app.router.add_post(path, handler)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


def prompt(length: int, start: int = 1) -> np.ndarray:
    """``length`` distinct token ids from ``start``: two prompts share exactly the
    tokens their ranges share (from 1: token 0 is the simulated model's EOS)."""
    return np.arange(start, start + length, dtype=TOKEN_DTYPE)


def gateway_stats(url: str, key: str | None = None) -> GatewayStats:
    """A gateway's ``/stats``; with an admin's ``key``, its per-tenant figures too."""
    headers = {"authorization": f"Bearer {key}"} if key else {}
    return stats_codec.decode(GatewayStats, httpx.get(f"{url}/stats", headers=headers).content)


def replica_stats(url: str, token: str = "") -> ReplicaStats:
    """One of our replicas' ``/stats`` (``token``: the fleet's, where it asks one)."""
    answer = httpx.get(f"{url}/stats", headers=bearer(token))
    return stats_codec.decode(ReplicaStats, answer.content)


def wait_until_checked(
    gateway: str, backends: int = 1, timeout_s: float = 60.0, key: str | None = None
) -> GatewayStats:
    """Until the gateway routes ``backends`` backends and has checked each of them (its
    canary prompts are answered: router/fleet/backend_check.py). ``key``: an admin's,
    where keys are configured, for the figures of /stats that name the backends."""

    def checked() -> bool:
        now = gateway_stats(gateway).backends
        return len(now) >= backends and all(b.routing_mode != "checking" for b in now)

    wait_for(checked, timeout_s, f"{gateway} checking its backends")
    return gateway_stats(gateway, key)


def settled(gateway: str, replicas: list[str], key: str | None = None) -> GatewayStats:
    """The gateway has checked every replica, and their statistics start from zero (the
    canaries of the check counted as requests). ``key``: as for wait_until_checked."""
    stats = wait_until_checked(gateway, len(replicas), key=key)
    for url in replicas:
        assert httpx.post(f"{url}/reset").status_code == 200
    return stats


#: A Llama-3-shaped chat template: a BOS, headed turns each ended by <|eot|>.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "<|start_header|>{{ m['role'] }}<|end_header|>\n\n{{ m['content'] }}<|eot|>"
    "{% endfor %}{% if add_generation_prompt %}<|start_header|>assistant<|end_header|>\n\n"
    "{% endif %}"
)
SPECIAL_TOKENS = ["<|begin|>", "<|eot|>", "<|start_header|>", "<|end_header|>"]
CORPUS = [
    "You are a helpful assistant for the support desk of a bicycle shop.",
    "Answer briefly, cite the manual, and never invent part numbers.",
    "How do I true a wheel? What tension should spokes have on a road bike?",
    "The quick brown fox jumps over the lazy dog, again and again.",
]


def build_hf_tokenizer(folder: Path, vocab_size: int = 400) -> Path:
    """A small byte-level BPE tokenizer, trained here, saved as a model's repository
    saves one (``tokenizer.json`` and ``tokenizer_config.json``): no download."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(CORPUS * 20, trainer)
    begin = tokenizer.token_to_id("<|begin|>")
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<|begin|> $A", special_tokens=[("<|begin|>", begin)]
    )
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    config = {"bos_token": "<|begin|>", "eos_token": "<|eot|>", "chat_template": CHAT_TEMPLATE}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


#: A small vLLM replica: its KV cache holds 7,808 tokens of the tiny model (244 blocks of
#: 32), so a few prompts sent straight to it evict what it held.
VLLM_ARGS = ("--kv-cache-memory-bytes", "16M", "--max-model-len", "4096")


@contextlib.contextmanager
def vllm_servers(
    model: Path, count: int, engine_args: tuple[str, ...] = VLLM_ARGS
) -> Iterator[list[VLLMServer]]:
    """``count`` vLLM servers of ``model`` on free loopback ports, started together and
    stopped (with their work folders) however the caller ends; in dev mode, so that a
    test can empty their caches (``/reset_prefix_cache``) as the bench does."""
    cores = len(os.sched_getaffinity(0))
    servers = [
        VLLMServer(
            VLLMConfig(str(model), engine_args, cpus=cores_of(i, count, cores), dev_mode=True),
            "127.0.0.1",
            Ports(free_port(), free_port(), free_port()),
        )
        for i in range(count)
    ]
    try:
        for server in servers:
            server.launch()
        for server in servers:
            server.wait_ready()
        yield servers
    finally:
        stop_together(servers)


def stop_together(servers: list[VLLMServer]) -> None:
    """Stop vLLM servers, each told at once so that their shutdowns overlap."""
    for server in servers:
        if server.process is not None and server.process.poll() is None:
            server.process.terminate()
    for server in servers:
        server.stop()


def vllm_backend(server: VLLMServer) -> str:
    """The gateway's ``--backend`` for a vLLM server: its URL and its KV events' sockets."""
    events = server.kv_events
    return f"{server.url},kv={events.endpoint},replay={events.replay_endpoint},topic={events.topic}"


def vllm_processes() -> list[psutil.Process]:
    """Every process of a vLLM server on this machine: API servers and engine cores."""
    found = []
    for process in psutil.process_iter(["cmdline"]):
        line = " ".join(process.info["cmdline"] or ())
        if "vllm.entrypoints.openai.api_server" in line or line.startswith("VLLM::EngineCore"):
            found.append(process)
    return found


def vllm_work_folders() -> set[str]:
    """The vLLM servers' work folders in the temporary directory."""
    return {p.name for p in Path(tempfile.gettempdir()).glob(WORK_PREFIX + "*")}


@contextlib.contextmanager
def leaves_no_vllm_behind(timeout_s: float = 30.0) -> Iterator[None]:
    """The vLLM servers started inside are gone once it ends: every process of theirs
    stopped (within ``timeout_s``), every work folder removed. Nothing is checked when
    the body fails: its own error is the one to see."""
    before, folders = {p.pid for p in vllm_processes()}, vllm_work_folders()
    yield

    def stopped() -> bool:
        return {p.pid for p in vllm_processes()} <= before

    wait_for(stopped, timeout_s, "every vLLM server stopped")
    assert vllm_work_folders() <= folders, "a vLLM server's work folder was left behind"


@contextlib.contextmanager
def logged_process(
    command: list[str],
    log: Path,
    ready_s: float = 60.0,
    stop_s: float = 30.0,
    env: dict[str, str] | None = None,
) -> Iterator[tuple[str, subprocess.Popen]]:
    """``prefix-router COMMAND`` on a free port (``env`` added to its environment), its
    stderr (its log) to ``log``: its URL once it answers, and its process; stopped
    (SIGINT, then a kill after ``stop_s``) however the caller ends."""
    port = free_port()
    with open(log, "w") as output:
        process = processes.start(command, port, stderr=output, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        processes.wait_until(url, process, timeout_s=ready_s)
        yield url, process
    finally:
        processes.stop(process, timeout_s=stop_s)


@contextlib.contextmanager
def logged_gateway(log: Path, *flags: str) -> Iterator[str]:
    """A gateway started with ``flags``, its log to ``log``: its URL, as ``logged_process``."""
    with logged_process(["gateway", *flags], log) as (url, _):
        yield url


def loopback_env(**more: str) -> dict[str, str]:
    """This process's environment, with Ray kept on 127.0.0.1 (see conftest.py), and
    ``more``: for the commands the tests start."""
    return {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", **more}


def prefix_router(
    *args: str, timeout_s: float = 300.0, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """A ``prefix-router`` command run to its end (in ``env``, else ``loopback_env()``),
    its output captured."""
    command = [sys.executable, "-m", "prefix_router", *args]
    return subprocess.run(
        command,
        capture_output=True,
        text=True,
        env=env or loopback_env(),
        timeout=timeout_s,
        check=False,
    )


def wait_for(condition: Callable[[], object], timeout_s: float = 10.0, what: str = "") -> float:
    """Poll ``condition`` until it holds; fail naming ``what`` after ``timeout_s``. The
    seconds it took. Tests await a condition, never sleep a fixed time for one."""
    start = time.monotonic()
    while not condition():
        assert time.monotonic() - start < timeout_s, f"{what or 'condition'}: {timeout_s} s"
        time.sleep(0.05)
    return time.monotonic() - start


async def awaited(condition: Callable[[], object], timeout_s: float = 20.0, what: str = "") -> None:
    """:func:`wait_for` inside an event loop: poll ``condition`` while the loop runs the
    code under test."""
    start = time.monotonic()
    while not condition():
        assert time.monotonic() - start < timeout_s, f"{what or 'condition'}: {timeout_s} s"
        await asyncio.sleep(0.02)


def indexed(stats: GatewayStats, token: str = "") -> bool:
    """The gateway has backends, and its index holds every KV event each of them
    published so far (``token``: the fleet's, where the replicas ask it)."""
    return bool(stats.backends) and all(
        b.kv_stream is not None
        and b.kv_stream.indexed_through == replica_stats(b.url, token).kv_event_batches
        for b in stats.backends
    )


async def gateway_reaches(
    client: httpx.AsyncClient,
    url: str,
    condition: Callable[[GatewayStats], bool],
    key: str | None = None,
    timeout_s: float = 30.0,
) -> GatewayStats:
    """Poll the gateway's ``/stats`` until ``condition`` holds: a test orders its
    requests by what the gateway has seen (queued, in flight), not by sleeps."""
    headers = {"authorization": f"Bearer {key}"} if key else {}
    deadline = time.monotonic() + timeout_s
    while True:
        response = await client.get(f"{url}/stats", headers=headers)
        stats = stats_codec.decode(GatewayStats, response.content)
        if condition(stats):
            return stats
        assert time.monotonic() < deadline, f"{url}/stats never reached the condition"
        await asyncio.sleep(0.01)


def in_flight(stats: GatewayStats) -> int:
    """Requests the gateway has sent to its backends that have not ended."""
    return sum(b.outstanding_requests for b in stats.backends)


def wait_until_indexed(gateway: str, timeout_s: float = 10.0, key: str | None = None) -> None:
    """Until the gateway at ``gateway`` has indexed every event its replicas published
    (``key``: an admin's, where keys are configured: /stats names the backends to it)."""
    wait_for(lambda: indexed(gateway_stats(gateway, key)), timeout_s, f"{gateway}'s index")
