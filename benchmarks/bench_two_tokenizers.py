"""A fleet of two models with two tokenizers behind one gateway: hit rate and prediction
accuracy per model (router/fleet/tokenizers.py).

    python -m benchmarks.bench_two_tokenizers [--conversations 24] [--turns 4]

Four simulated replicas, two serving ``llama`` with one Hugging Face tokenizer and two
serving ``qwen`` with another (the tiny model's BPE, trained here with two vocabularies,
so the same text gives different ids). One gateway, given ``llama``'s tokenizer only, as
a gateway of one tokenizer per fleet was. Then, per model, ``--conversations``
conversations of ``--turns`` turns, each opening with one of four system prompts of the
model, played one turn at a time. Per model: the token hit rate the engines found, and
how often the gateway's prediction of the cached tokens was exact, within a stride (the
64 tokens it keys a prompt by), or over what the engine found (from each answer's
headers and usage).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import httpx

from benchmarks.predictions import HEADER, play, row
from deploy.processes import running
from replica.tiny_model import TinyModelConfig, write_tiny_model

MODELS = ("llama", "qwen")
#: The router's resolution: it keys a prompt every stride of 4 blocks of 16 tokens.
STRIDE_TOKENS = 64


def checked_backends(url: str, count: int, timeout_s: float = 60.0) -> list[dict]:
    """The gateway's backends once it has checked all ``count`` of them."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        backends = httpx.get(f"{url}/stats").json()["backends"]
        if len(backends) == count and all(b["routing_mode"] != "checking" for b in backends):
            return backends
        time.sleep(0.2)
    raise TimeoutError(f"{url} still checks its backends after {timeout_s} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--conversations", type=int, default=24)
    parser.add_argument("--turns", type=int, default=4)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        tokenizers = {
            model: str(write_tiny_model(Path(folder) / model, TinyModelConfig(vocab_size=size)))
            for model, size in (("llama", 1024), ("qwen", 768))
        }
        small = ["--num-blocks", "1024", "--host-blocks", "0", "--speedup", "20"]
        replicas = [
            ["replica", "--model", model, "--tokenizer", tokenizers[model], *small]
            for model in ("llama", "llama", "qwen", "qwen")
        ]
        with running(*replicas) as urls:
            backends = [f"--backend={url}" for url in urls]
            gateway = ["gateway", "--model", "llama", "--tokenizer", tokenizers["llama"]]
            with running([*gateway, *backends]) as (url,):
                checked = checked_backends(url, len(urls))
                modes = ", ".join(f"{b['model']}: {b['routing_mode']}" for b in checked)
                print(f"backends checked: {modes}")
                answers = {
                    model: play(url, model, model, args.conversations, args.turns)
                    for model in MODELS
                }
    print(HEADER.format(what="model"))
    for model, played in answers.items():
        print(row(model, played, STRIDE_TOKENS))


if __name__ == "__main__":
    main()
