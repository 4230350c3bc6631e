"""A vLLM server of several data-parallel engines behind the gateway: hit rate and
prediction accuracy per rank (router/fleet/data_parallel.py).

    python -m benchmarks.bench_data_parallel [--ranks 2] [--conversations 24] [--turns 4]
    python -m benchmarks.bench_data_parallel --gateway URL --model MODEL

One vLLM server of the tiny model (vLLM's CPU build: written here, no download) with
``--data-parallel-size --ranks``, its KV events on ZMQ, and a gateway in front of it
configured as its card says; then ``--conversations`` chats of ``--turns`` turns, each
opening with one of four long system prompts, played one turn at a time. Per replica
the gateway routed to (one per rank), and in all: the token hit rate the engines found,
and how often the gateway's predictions of the cached tokens were exact, within a
stride, or over what the engine found (benchmarks/predictions.py).

With ``--gateway``, the conversations are played through a gateway already running
(another commit's, say: one that routes the server as a single replica, for the
comparison in docs/vllm.md), its server's cache emptied first where it is in dev mode.
"""

from __future__ import annotations

import argparse
import tempfile
import time
import uuid
from pathlib import Path

import httpx

from benchmarks.predictions import HEADER, Answer, play, row
from deploy.processes import free_port, free_ports, running
from replica.tiny_model import write_tiny_model
from replica.vllm_server import Ports, VLLMConfig, VLLMServer

#: The gateway keys a prompt every 4 blocks of vLLM's CPU build's 32 tokens.
STRIDE_TOKENS = 128
ENGINE_ARGS = ("--kv-cache-memory-bytes", "16M", "--max-model-len", "4096")


def report(answers: list[Answer]) -> None:
    print(HEADER.format(what="replica"))
    for replica in sorted({a.replica for a in answers}):
        print(row(replica, (a for a in answers if a.replica == replica), STRIDE_TOKENS))
    print(row("all", answers, STRIDE_TOKENS))


def checked(url: str, timeout_s: float = 180.0) -> list[dict]:
    """The gateway's backends once it has checked every one."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        backends = httpx.get(f"{url}/stats").json()["backends"]
        if backends and all(b["routing_mode"] != "checking" for b in backends):
            return backends
        time.sleep(0.5)
    raise TimeoutError(f"{url} still checks its backends after {timeout_s} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=2, help="vLLM's --data-parallel-size")
    parser.add_argument("--conversations", type=int, default=24)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--gateway", help="play through this gateway instead")
    parser.add_argument("--model", help="with --gateway: the model its server serves")
    args = parser.parse_args()
    tag = uuid.uuid4().hex[:8]  # prompts no cache holds yet
    if args.gateway:
        for backend in checked(args.gateway):
            httpx.post(f"{backend['url']}/reset_prefix_cache")  # dev mode only
        report(play(args.gateway, args.model, tag, args.conversations, args.turns))
        return
    with tempfile.TemporaryDirectory() as folder:
        model = str(write_tiny_model(Path(folder) / "tiny"))
        events = free_ports(2 * args.ranks)  # rank R on events + R, its replays after
        engine_args = (*ENGINE_ARGS, "--data-parallel-size", str(args.ranks))
        ports = Ports(free_port(), events, events + args.ranks)
        server = VLLMServer(VLLMConfig(model, engine_args), "127.0.0.1", ports)
        try:
            server.start()
            stream = server.kv_events
            backend = (
                f"--backend={server.url},kv={stream.endpoint},"
                f"replay={stream.replay_endpoint},topic={stream.topic}"
            )
            flags = ["--model", model, "--tokenizer", model, "--block-size", "32"]
            with running(["gateway", backend, *flags]) as (url,):
                modes = ", ".join(f"{b['replica_id']}: {b['routing_mode']}" for b in checked(url))
                print(f"backends checked: {modes}")
                report(play(url, model, tag, args.conversations, args.turns))
        finally:
            server.stop()


if __name__ == "__main__":
    main()
