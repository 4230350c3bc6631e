"""Speed of the router core and of the offline replayer.

- Routing decision time: ``cache_aware`` choosing among 16, 64, 256 and 1,024 replicas
  (``--replicas``) for an 8k-token prompt whose prefix the index knows on two of them,
  and the hashing of that prompt's identities.
- Tokenizing a chat turn with a Hugging Face tokenizer (``--tokenizer``, by default
  the tiny Llama's byte-level BPE): the whole rendered conversation encoded at once,
  against the gateway's way, its earlier messages' pieces found in the cache
  (replica/api/token_cache.py) and only the new question encoded.
- Replay time: the whole Mooncake conversation trace on 8 replicas, per policy.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from loadtest.replay import ReplayConfig, replay
from loadtest.report import replay_row
from loadtest.workloads import load_workload
from replica.api.identity import DEFAULT_MODEL, identity_seed, prefix_keys
from replica.api.model_tokenizer import HFTokenizer
from replica.api.tokenizer import TOKEN_DTYPE
from router.core import ReplicaState, RoutingRequest
from router.fleet import load
from router.index.key_cache import HEAD_TOKENS, PrefixKeyCache
from router.policies import PolicyConfig, make_policy

TRACE = Path(__file__).resolve().parents[2] / "shared" / "traces" / "mooncake_conversation.jsonl"
BLOCK_SIZE, STRIDE = PolicyConfig().block_size, PolicyConfig().index.stride


def bench_decision(replicas: int, prompt_tokens: int, repeats: int) -> tuple[float, float]:
    """Median microseconds per decision, and per hashing of the prompt's strides."""
    rng = np.random.default_rng(0)
    fleet = [ReplicaState(f"replica-{i}", 26_000) for i in range(replicas)]
    policy = make_policy("cache_aware", time.monotonic, rng, PolicyConfig())
    for replica in fleet:
        policy.on_replica_added(replica)
    seed = identity_seed(DEFAULT_MODEL)
    prompts = [
        rng.integers(0, 2**32, prompt_tokens, dtype=np.uint64).astype(TOKEN_DTYPE)
        for _ in range(64)
    ]
    requests = []
    for i, tokens in enumerate(prompts):  # every prompt known on one replica, half of it on another
        hashes = prefix_keys(tokens, BLOCK_SIZE, STRIDE, seed)
        policy.on_dispatch(RoutingRequest(f"warm-{i}", prompt_tokens, hashes), fleet[i % replicas])
        policy.on_dispatch(
            RoutingRequest(f"half-{i}", prompt_tokens // 2, hashes[: len(hashes) // 2]),
            fleet[(i + 1) % replicas],
        )
        requests.append(RoutingRequest(f"r{i}", prompt_tokens, hashes))
    for replica in fleet:
        replica.outstanding_requests = int(rng.integers(0, 8))
        replica.outstanding_prefill_tokens = int(rng.integers(0, 20_000))
        load.changed(replica)
    decisions, hashing = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        for request in requests:
            policy.choose(request, fleet)
        decisions.append((time.perf_counter() - start) / len(requests))
        start = time.perf_counter()
        for tokens in prompts:
            prefix_keys(tokens, BLOCK_SIZE, STRIDE, seed)
        hashing.append((time.perf_counter() - start) / len(prompts))
    return 1e6 * statistics.median(decisions), 1e6 * statistics.median(hashing)


def bench_seen_turn(prompt_tokens: int, new_tokens: int, repeats: int) -> float:
    """Median microseconds to key a conversation's next turn (``new_tokens`` more) with
    the gateway's key cache holding the turn before (router/index/key_cache.py)."""
    rng = np.random.default_rng(1)
    seed = identity_seed(DEFAULT_MODEL)
    history = rng.integers(0, 2**32, prompt_tokens, dtype=np.uint64).astype(TOKEN_DTYPE)
    times = []
    for _ in range(repeats):
        cache = PrefixKeyCache(BLOCK_SIZE, STRIDE)
        cache.keys(history, seed)
        turn = np.concatenate([history, rng.integers(0, 2**32, new_tokens).astype(TOKEN_DTYPE)])
        start = time.perf_counter()
        keys = cache.keys(turn, seed)
        times.append(time.perf_counter() - start)
        assert keys == prefix_keys(turn, BLOCK_SIZE, STRIDE, seed)  # exact
    return 1e6 * statistics.median(times)


def bench_trace(policies: list[str], replicas: int) -> None:
    workload = load_workload(f"trace:{TRACE}")
    config = ReplayConfig(replicas=replicas, capacity_blocks=26_000, host_blocks=0)
    for policy in policies:
        start = time.perf_counter()
        row = replay_row(replay(workload, config, policy))
        seconds = time.perf_counter() - start
        print(
            f"mooncake trace, {row['requests']} requests, {replicas} replicas, {policy}: "
            f"{seconds:.1f} s (token hit rate {row['token_hit_rate']:.1%})"
        )


def bench_tokenizing(tokenizer: HFTokenizer, prompt_tokens: int, repeats: int) -> dict[str, float]:
    """Milliseconds (medians) to render a conversation of about ``prompt_tokens``
    tokens with its next question, to encode it whole, and to encode it as the gateway
    does once the turn before was encoded."""
    assert tokenizer.pieces is not None and tokenizer.render is not None
    rng = np.random.default_rng(0)
    words = ("cache", "prefix", "route", "replica", "token", "block", "engine", "batch")

    def text(count: int) -> str:
        return " ".join(words[i] for i in rng.integers(0, len(words), count))

    messages = [{"role": "system", "content": text(1500)}]
    while len(tokenizer.apply_chat_template(messages)) < prompt_tokens:
        messages += [
            {"role": "user", "content": text(100)},
            {"role": "assistant", "content": text(300)},
        ]
    timings: dict[str, list[float]] = {"render": [], "whole": [], "cached": []}
    for _ in range(repeats):
        turn = [*messages, {"role": "user", "content": text(30)}]
        tokenizer.pieces.clear()
        tokenizer.apply_chat_template(messages)  # the turn before, as the gateway saw it
        start = time.perf_counter()
        rendered = tokenizer.render(
            messages=turn, add_generation_prompt=True, **tokenizer.special_tokens
        )
        rendered_at = time.perf_counter()
        whole = tokenizer.tokenizer.encode(rendered, add_special_tokens=False).ids
        whole_at = time.perf_counter()
        cached = tokenizer.apply_chat_template(turn)
        cached_at = time.perf_counter()
        assert cached.tolist() == whole  # exact
        timings["render"].append(rendered_at - start)
        timings["whole"].append(whole_at - rendered_at)
        timings["cached"].append(cached_at - whole_at)
    return {name: 1000 * statistics.median(values) for name, values in timings.items()}


def default_tokenizer() -> HFTokenizer:
    """The tiny Llama's tokenizer, written to a temporary folder."""
    from replica.tiny_model import write_tiny_model

    folder = Path(tempfile.mkdtemp(prefix="bench-router-"))
    return HFTokenizer.load(write_tiny_model(folder))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--replicas", default="16,64,256,1024", help="fleet sizes to decide among")
    parser.add_argument(
        "--prompt-tokens", default="8192", help="prompt lengths, e.g. 8192,65536,240000"
    )
    parser.add_argument(
        "--tokenizer", help="a Hugging Face tokenizer's folder (default: the tiny Llama's)"
    )
    parser.add_argument("--tokenize-repeats", type=int, default=5)
    parser.add_argument("--trace-policies", default="round_robin,cache_aware")
    parser.add_argument("--no-trace", action="store_true", help="skip the minute-long trace replay")
    args = parser.parse_args(argv)
    for tokens in (int(n) for n in args.prompt_tokens.split(",")):
        for replicas in (int(n) for n in args.replicas.split(",")):
            decision_us, hashing_us = bench_decision(replicas, tokens, args.repeats)
            print(
                f"routing decision, {tokens:>7}-token prompt, {replicas:>5} replicas, "
                f"cache_aware: {decision_us:6.1f} us   (hashing that prompt's identities "
                f"every {BLOCK_SIZE * STRIDE} tokens: {hashing_us:.1f} us)"
            )
        if tokens >= HEAD_TOKENS:
            seen_us = bench_seen_turn(tokens, 200, 10 * args.repeats)
            print(
                f"keying the next turn (200 new tokens) of a {tokens}-token conversation "
                f"the gateway has seen: {seen_us:.1f} us"
            )
    tokenizer = HFTokenizer.load(Path(args.tokenizer)) if args.tokenizer else default_tokenizer()
    for tokens in (int(n) for n in args.prompt_tokens.split(",")):
        ms = bench_tokenizing(tokenizer, tokens, args.tokenize_repeats)
        print(
            f"tokenizing a chat turn of ~{tokens:>7} tokens: rendering {ms['render']:.1f} ms, "
            f"encoding it whole {ms['whole']:.1f} ms, with the earlier messages cached "
            f"{ms['cached']:.1f} ms"
        )
    if not args.no_trace:
        bench_trace(args.trace_policies.split(","), 8)


if __name__ == "__main__":
    main()
