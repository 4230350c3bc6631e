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
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from deploy.processes import running
from replica.tiny_model import TinyModelConfig, write_tiny_model

MODELS = ("llama", "qwen")
#: The router's resolution: it keys a prompt every stride of 4 blocks of 16 tokens.
STRIDE_TOKENS = 64


@dataclass
class Figures:
    prompt_tokens: int = 0
    cached_tokens: int = 0
    predictions: list[tuple[int, int]] = field(default_factory=list)

    def row(self, model: str) -> str:
        exact = sum(p == c for p, c in self.predictions)
        close = sum(abs(p - c) < STRIDE_TOKENS for p, c in self.predictions)
        over = sum(p > c for p, c in self.predictions)
        n = len(self.predictions)
        return (
            f"| {model} | {n} | {self.cached_tokens / self.prompt_tokens:.1%} | "
            f"{exact / n:.0%} | {close / n:.0%} | {over / n:.0%} |"
        )


def system_prompt(model: str, index: int) -> str:
    return f"You are {model}'s assistant number {index} for the support desk of a shop. " * 25


def play(url: str, model: str, conversations: int, turns: int) -> Figures:
    figures = Figures()
    with httpx.Client(base_url=url, timeout=60) as client:
        for conversation in range(conversations):
            messages = [{"role": "system", "content": system_prompt(model, conversation % 4)}]
            for turn in range(turns):
                messages.append({"role": "user", "content": f"question {conversation}.{turn}"})
                body = {"model": model, "messages": messages, "max_tokens": 8}
                answer = client.post("/v1/chat/completions", json=body)
                answer.raise_for_status()
                usage = answer.json()["usage"]
                cached = usage["prompt_tokens_details"]["cached_tokens"]
                predicted = int(answer.headers["x-prefix-router-predicted-cached-tokens"])
                figures.prompt_tokens += usage["prompt_tokens"]
                figures.cached_tokens += cached
                figures.predictions.append((predicted, cached))
                reply = answer.json()["choices"][0]["message"]["content"]
                messages.append({"role": "assistant", "content": reply})
                time.sleep(0.05)  # the answer's KV events on their way to the gateway
    return figures


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
                figures = {
                    model: play(url, model, args.conversations, args.turns) for model in MODELS
                }
    print("| model | requests | token hit rate | predictions exact | within a stride | over |")
    print("|---|---:|---:|---:|---:|---:|")
    for model, measured in figures.items():
        print(measured.row(model))


if __name__ == "__main__":
    main()
