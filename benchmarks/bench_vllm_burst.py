"""A burst on one of two vLLM servers that the gateway never saw: its TTFT, with vLLM's
own load read from ``/metrics`` (router/fleet/vllm_load.py) against a gateway that
counts only the requests it sent itself.

    python -m benchmarks.bench_vllm_burst [--rounds 3] [ROOT ...]

Two vLLM servers of the tiny model (vLLM's CPU build: written here, no download), each
on a core. Per round and per ROOT (a checkout of this project with its virtualenv;
default: this one), a gateway of that checkout in front of both, their caches emptied;
then ``--burst`` long answers sent straight to the first server (other clients of the
same fleet, a batch job: traffic this gateway does not route), and meanwhile
``--requests`` fresh prompts through the gateway, one every ``--gap-s`` seconds. Each
prompt's time to its one token is its TTFT. Per checkout, medians over the rounds:
TTFT p50 and p99, and the share of the prompts sent to the busy server. The roots
alternate within each round, so the machine's noise falls on both.

The comparison in docs/vllm.md: this checkout against a worktree at 1f97bb3, the
commit before the gateway read vLLM's load (``git worktree add /tmp/before 1f97bb3`` and
a link to this checkout's ``.venv``).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import subprocess
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np

from deploy.processes import free_port, free_ports, stop, wait_until
from replica.api.tokenizer import WORDS
from replica.tiny_model import write_tiny_model
from replica.vllm_server import Ports, VLLMConfig, VLLMServer

ENGINE_ARGS = ("--kv-cache-memory-bytes", "16M", "--max-model-len", "4096")
SYLLABLES = [int(w).to_bytes(4, "little").decode() for w in WORDS]


def text(rng: np.random.Generator, words: int) -> str:
    """Words the tiny model's tokenizer holds whole: about one token each."""
    return "".join(SYLLABLES[i] for i in rng.integers(0, len(SYLLABLES), words))


@dataclass(frozen=True)
class Round:
    """One round through one checkout's gateway: each prompt's TTFT and server."""

    ttfts_s: list[float]
    servers: list[str]

    def busy_share(self, busy: str) -> float:
        return self.servers.count(busy) / len(self.servers)


def commit_of(root: Path) -> str:
    done = subprocess.run(
        ["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    )
    return done.stdout.strip() or str(root)


@contextlib.contextmanager
def gateway(root: Path, servers: list[VLLMServer], model: str) -> Iterator[str]:
    """The gateway of the checkout at ``root`` in front of ``servers``, once it has
    checked both."""
    port = free_port()
    backends = [
        f"--backend={s.url},kv={s.kv_events.endpoint},replay={s.kv_events.replay_endpoint},"
        f"topic={s.kv_events.topic}"
        for s in servers
    ]
    flags = ["--model", model, "--tokenizer", model, "--block-size", "32", "--stride", "1"]
    command = [str(root / ".venv/bin/python"), "-m", "prefix_router", "gateway"]
    process = subprocess.Popen(
        [*command, "--port", str(port), *backends, *flags],
        cwd=root,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"

    def checked(answer: httpx.Response) -> bool:
        backends = answer.json()["backends"] if answer.status_code == 200 else []
        return len(backends) == 2 and all(b["routing_mode"] != "checking" for b in backends)

    try:
        wait_until(url, process, checked, path="/stats", timeout_s=120)
        yield url
    finally:
        stop(process)


def ttft(url: str, model: str, prompt: str, at: float) -> tuple[float, str]:
    """One prompt sent at ``at`` (monotonic): its time to its one token, and its server."""
    time.sleep(max(0.0, at - time.monotonic()))
    started = time.monotonic()
    body = {"model": model, "prompt": prompt, "max_tokens": 1}
    answer = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    answer.raise_for_status()
    return time.monotonic() - started, answer.headers["x-prefix-router-replica"]


def burst_round(
    url: str, servers: list[VLLMServer], model: str, args: argparse.Namespace, seed: int
) -> Round:
    for server in servers:
        httpx.post(f"{server.url}/reset_prefix_cache").raise_for_status()
    rng = np.random.default_rng(seed)
    busy = servers[0].url
    long_answer = {"model": model, "max_tokens": args.burst_tokens, "ignore_eos": True}
    with ThreadPoolExecutor(args.burst + args.requests) as pool:
        burst = [
            pool.submit(
                httpx.post,
                f"{busy}/v1/completions",
                json={**long_answer, "prompt": text(rng, args.burst_prompt_words)},
                timeout=300,
            )
            for _ in range(args.burst)
        ]
        time.sleep(1.0)  # the burst running, as the gateway's next read of /metrics says
        start = time.monotonic()
        prompts = [text(rng, args.prompt_words) for _ in range(args.requests)]
        sent = [
            pool.submit(ttft, url, model, prompt, start + i * args.gap_s)
            for i, prompt in enumerate(prompts)
        ]
        answers = [f.result() for f in sent]
        for f in burst:
            f.result().raise_for_status()
    return Round([t for t, _ in answers], [s for _, s in answers])


def p99(values: list[float]) -> float:
    return float(np.percentile(values, 99))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("roots", nargs="*", type=Path, default=[Path(".")])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--burst", type=int, default=16, help="long answers straight to one")
    parser.add_argument("--burst-tokens", type=int, default=800)
    parser.add_argument("--burst-prompt-words", type=int, default=1000)
    parser.add_argument("--requests", type=int, default=24, help="prompts through the gateway")
    parser.add_argument("--prompt-words", type=int, default=600)
    parser.add_argument("--gap-s", type=float, default=0.25)
    args = parser.parse_args()
    roots = [root.resolve() for root in args.roots]
    with tempfile.TemporaryDirectory() as folder:
        model = str(write_tiny_model(Path(folder) / "tiny"))
        servers = []
        try:
            for core in range(2):
                events = free_ports(2)
                config = VLLMConfig(model, ENGINE_ARGS, dev_mode=True, cpus=(core,))
                servers.append(
                    VLLMServer(config, "127.0.0.1", Ports(free_port(), events, events + 1))
                )
            for server in servers:
                server.start()
            rounds: dict[Path, list[Round]] = {root: [] for root in roots}
            for number in range(args.rounds):
                for root in roots:
                    with gateway(root, servers, model) as url:
                        rounds[root].append(burst_round(url, servers, model, args, seed=number))
        finally:
            for server in servers:
                server.stop()
    busy = servers[0].url
    print(
        f"{args.burst} answers of {args.burst_tokens} tokens straight to one server; "
        f"{args.requests} prompts of ~{args.prompt_words} tokens through the gateway, "
        f"one every {args.gap_s} s; medians of {args.rounds} rounds"
    )
    print(f"{'gateway at':<14}{'TTFT p50':>10}{'TTFT p99':>10}{'to the busy server':>20}")
    for root, played in rounds.items():
        p50 = statistics.median(statistics.median(r.ttfts_s) for r in played)
        tail = statistics.median(p99(r.ttfts_s) for r in played)
        share = statistics.median(r.busy_share(busy) for r in played)
        print(f"{commit_of(root):<14}{p50 * 1e3:>8.0f}ms{tail * 1e3:>8.0f}ms{share:>20.0%}")


if __name__ == "__main__":
    main()
