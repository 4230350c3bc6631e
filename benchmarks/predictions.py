"""Conversations played through a gateway one turn at a time, and how well it predicted
what each answer found cached: the figures of the benchmarks that compare the index
with the engines (bench_two_tokenizers, bench_data_parallel).

Each answer carries the gateway's prediction (``x-prefix-router-predicted-cached-tokens``)
and the replica it chose (``x-prefix-router-replica``); its usage says what the engine
found cached. A prediction is exact, within a stride of the router's keys (it keys a
prompt every stride: closer than that is as close as it can say), or over (the index
believed more than the engine held: the error that misroutes).
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass

import httpx


@dataclass(frozen=True)
class Answer:
    replica: str
    prompt_tokens: int
    cached_tokens: int
    predicted_tokens: int


def play(url: str, model: str, tag: str, conversations: int, turns: int) -> list[Answer]:
    """``conversations`` chats of ``turns`` turns for ``model``, each opening with one of
    four long system prompts (``tag`` makes them new to every cache), played in turn."""
    answers = []
    with httpx.Client(base_url=url, timeout=120) as client:
        for conversation in range(conversations):
            system = f"{tag}: you are assistant {conversation % 4} of a bicycle shop. " * 25
            messages = [{"role": "system", "content": system}]
            for turn in range(turns):
                messages.append({"role": "user", "content": f"question {conversation}.{turn}"})
                body = {"model": model, "messages": messages, "max_tokens": 8}
                answer = client.post("/v1/chat/completions", json=body)
                answer.raise_for_status()
                usage, headers = answer.json()["usage"], answer.headers
                answers.append(
                    Answer(
                        headers["x-prefix-router-replica"],
                        usage["prompt_tokens"],
                        usage["prompt_tokens_details"]["cached_tokens"],
                        int(headers["x-prefix-router-predicted-cached-tokens"]),
                    )
                )
                reply = answer.json()["choices"][0]["message"]["content"]
                messages.append({"role": "assistant", "content": reply})
                time.sleep(0.05)  # the answer's KV events on their way to the gateway
    return answers


def row(label: str, answers: Iterable[Answer], stride_tokens: int) -> str:
    """A markdown row: requests, token hit rate, predictions exact, within a stride,
    over."""
    answers = list(answers)
    n = len(answers)
    prompt = sum(a.prompt_tokens for a in answers)
    cached = sum(a.cached_tokens for a in answers)
    misses = [a.predicted_tokens - a.cached_tokens for a in answers]
    exact = sum(m == 0 for m in misses)
    close = sum(abs(m) < stride_tokens for m in misses)
    over = sum(m > 0 for m in misses)
    return (
        f"| {label} | {n} | {cached / prompt:.1%} | "
        f"{exact / n:.0%} | {close / n:.0%} | {over / n:.0%} |"
    )


HEADER = (
    "| {what} | requests | token hit rate | predictions exact | within a stride | over |\n"
    "|---|---:|---:|---:|---:|---:|"
)
