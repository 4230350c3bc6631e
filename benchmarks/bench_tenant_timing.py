"""What one tenant can learn by timing the gateway: whether another tenant sent a long
text first.

    python -m benchmarks.bench_tenant_timing [--tokens 8000,64000,240000] [--repeats 10]

One simulated replica made fast (``--speedup 1000``) and one gateway with two API keys
(tenants a and b), both with the tiny model's tokenizer (``prefix-router tiny-model``).
For each length, ``--repeats`` times: tenant a sends a chat whose system prompt is a
fresh text of that many tokens; tenant b then sends the same chat (*after a*), and a
chat with another fresh text of the same length (*fresh*). Prints the medians of b's
time to first token, streamed, as b sees it: equal medians mean that b cannot tell
whether a sent the text. Beside them, in this process with the same tokenizer, the
tokenization alone of *after a* and *fresh*, with the cache of chats' pieces shared by
every tenant (as the gateway had it until its pieces were scoped by tenant) and scoped
by tenant (as now).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

from deploy.processes import running
from replica.api.model_tokenizer import HFTokenizer
from replica.tiny_model import write_tiny_model

KEYS = {"a": "bench-key-of-tenant-a", "b": "bench-key-of-tenant-b"}
WORDS = ["route", "the", "prefix", "cache", "of", "every", "replica", "block", "token", "queue"]


def text_of(tokens: int, rng: np.random.Generator, tokenizer: HFTokenizer) -> str:
    """A fresh text of about ``tokens`` tokens: random words, sized by a sample."""
    sample = " ".join(rng.choice(WORDS, 2000))
    per_word = len(tokenizer.encode(sample)) / 2000
    return " ".join(rng.choice(WORDS, int(tokens / per_word)))


def chat(system: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": system}, {"role": "user", "content": "Summarise."}]


def ttft_s(client: httpx.Client, url: str, tenant: str, system: str) -> float:
    """Seconds from sending to the first streamed token, as the tenant sees it."""
    body = {"messages": chat(system), "max_tokens": 2, "stream": True}
    headers = {"authorization": f"Bearer {KEYS[tenant]}"}
    start = time.perf_counter()
    with client.stream("POST", f"{url}/v1/chat/completions", json=body, headers=headers) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{tenant}: {r.status_code} {r.read().decode()[:300]}")
        for line in r.iter_lines():
            if line.startswith("data: ") and '"content"' in line:
                return time.perf_counter() - start
    raise RuntimeError("no token streamed")


def tokenize_s(tokenizer: HFTokenizer, system: str, scope: str | None) -> float:
    start = time.perf_counter()
    tokenizer.apply_chat_template(chat(system), cache_scope=scope)
    return time.perf_counter() - start


def in_process(tokenizer: HFTokenizer, texts: list[tuple[str, str]], scoped: bool) -> list[float]:
    """Medians (ms) of tokenizing *after a* and *fresh*, the cache scoped or shared."""
    after, fresh = [], []
    for sent_by_a, other in texts:
        tokenize_s(tokenizer, sent_by_a, "a" if scoped else None)
        after.append(tokenize_s(tokenizer, sent_by_a, "b" if scoped else None))
        fresh.append(tokenize_s(tokenizer, other, "b" if scoped else None))
    return [1000 * statistics.median(after), 1000 * statistics.median(fresh)]


def row(
    client: httpx.Client, url: str, tokenizer: HFTokenizer, texts: list[tuple[str, str]]
) -> str:
    """One length's medians: b's TTFT after a and fresh, then tokenizing in-process."""
    after, fresh = [], []
    for sent_by_a, other in texts:
        ttft_s(client, url, "a", sent_by_a)
        after.append(ttft_s(client, url, "b", sent_by_a))
        fresh.append(ttft_s(client, url, "b", other))
    shared = in_process(tokenizer, texts, scoped=False)
    scoped = in_process(tokenizer, texts, scoped=True)
    tokens = len(tokenizer.encode(texts[0][0]))
    return (
        f"| {tokens:,} | {1000 * statistics.median(after):.0f} ms | "
        f"{1000 * statistics.median(fresh):.0f} ms | {shared[0]:.0f} / {shared[1]:.0f} ms | "
        f"{scoped[0]:.0f} / {scoped[1]:.0f} ms |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="8000,64000,240000")
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    lengths = [int(t) for t in args.tokens.split(",")]
    folder = Path(tempfile.mkdtemp(prefix="bench-tenant-timing-"))
    model = str(write_tiny_model(folder / "model"))
    keys = folder / "keys.txt"
    keys.write_text("".join(f"{key} {tenant}\n" for tenant, key in KEYS.items()))
    tokenizer = HFTokenizer.load(Path(model))
    rng = np.random.default_rng(0)
    blocks = str(max(lengths) * 3 // 16)  # the longest chat, twice, and room to spare
    replica = ["replica", "--tokenizer", model, "--speedup", "1000", "--num-blocks", blocks]
    gateway = ["gateway", "--tokenizer", model, "--api-keys-file", str(keys)]
    gateway += ["--max-prompt-tokens", str(2 * max(lengths))]
    print("| tokens | b's TTFT after a | b's TTFT fresh | tokenize after a / fresh, shared "
          "cache | tokenize after a / fresh, scoped |")  # fmt: skip
    print("|---:|---:|---:|---:|---:|")
    with (
        running(replica) as (backend,),
        running([*gateway, f"--backend={backend}"]) as (url,),
        httpx.Client(timeout=600) as client,
    ):
        for tokens in lengths:
            texts = [
                (text_of(tokens, rng, tokenizer), text_of(tokens, rng, tokenizer))
                for _ in range(args.repeats)
            ]
            print(row(client, url, tokenizer, texts), flush=True)


if __name__ == "__main__":
    main()
