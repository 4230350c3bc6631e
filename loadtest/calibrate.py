"""``prefix-router calibrate``: fit the cost model to a live engine.

It times the server at ``--backend`` (any OpenAI-compatible server that streams and
reports usage: vLLM, SGLang, or our simulated replica) over a sweep: requests alone at
several prompt lengths and cached fractions (the prefix sent first, then the prompt
with a new suffix; the cached tokens as the server reports them), and batches of
sequences decoding together at several contexts. It fits the step costs by least
squares (``replica/calibration.py``), prints each term and the fit's residuals, and
writes a profile that ``--profile FILE`` gives to ``replay``, ``bench`` and the
simulated replica, with the KV capacity the server reports (vLLM's
``vllm:cache_config_info``).

Prompts are token ids drawn at random (every request its own), so no tokenizer is
needed and none is guessed. Keep the server to yourself while it runs: other traffic
makes every sample slower.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
from tqdm import tqdm

from loadtest.plots import plt, save_figure
from replica.api.card import EngineCard, vllm_cache_config
from replica.api.cost_model import CostProfile, get_profile
from replica.api.fleet_token import bearer, fleet_token
from replica.calibration import TERMS, DecodeSample, Fit, PrefillSample, Sample, fit
from router.fleet.backends import describe

#: The most of the engine's KV a decode batch may take: the rest for what it still holds.
KV_USE = 0.8
#: Token ids prompts are drawn from: inside every vocabulary we serve (vLLM's tiny
#: model has 8,000, the simulated one any).
TOKEN_IDS = (300, 500)


@dataclass(frozen=True)
class CalibrateConfig:
    backend: str
    model: str | None = None
    prompt_lengths: tuple[int, ...] = (128, 512, 1024, 2048)
    cached_fractions: tuple[float, ...] = (0.0, 0.5, 0.9)
    batch_sizes: tuple[int, ...] = (1, 2, 4, 8)
    decode_contexts: tuple[int, ...] = (256, 1024)
    decode_tokens: int = 32
    repeats: int = 3
    #: The engine's prefill chunk (vLLM's ``--max-num-batched-tokens``).
    chunk_tokens: int = 2048
    #: What the profile takes from elsewhere: KV bytes per token, weights.
    base_profile: str = "llama3-8b-h100"
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.backend.startswith(("http://", "https://")):
            raise ValueError(f"--backend {self.backend!r}: its URL needs http:// or https://")
        if min(self.prompt_lengths, default=0) < 2 or self.chunk_tokens < 1:
            raise ValueError("prompt lengths must be at least 2 tokens, the chunk at least 1")
        if not all(0 <= f < 1 for f in self.cached_fractions):
            raise ValueError("cached fractions must lie in [0, 1)")
        if len(set(self.batch_sizes)) < 2 or min(self.batch_sizes) < 1:
            raise ValueError("--batch-sizes needs two sizes at least, each at least 1")
        if self.decode_tokens < 4 or self.repeats < 1:
            raise ValueError("--decode-tokens must be at least 4 and --repeats at least 1")
        get_profile(self.base_profile)


class Server:
    """Timed requests to one server, each prompt fresh token ids."""

    def __init__(self, session: aiohttp.ClientSession, url: str, model: str, seed: int) -> None:
        self.session, self.url, self.model = session, url, model
        self.rng = np.random.default_rng(seed)

    def prompt(self, tokens: int) -> list[int]:
        return self.rng.integers(*TOKEN_IDS, size=tokens).tolist()

    async def stream(self, prompt: list[int], max_tokens: int) -> tuple[list[float], int | None]:
        """The arrival time of each generated token, and the cached tokens reported."""
        body = {
            "model": self.model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        times: list[float] = []
        cached = None
        async with self.session.post(f"{self.url}/v1/completions", json=body) as response:
            if response.status != 200:
                raise ValueError(f"{self.url} answered {response.status}: {await response.text()}")
            async for line in response.content:
                text = line.decode().strip()
                if not text.startswith("data: ") or text == "data: [DONE]":
                    continue
                chunk = json.loads(text[6:])
                if chunk.get("choices"):
                    times.append(time.perf_counter())
                usage = chunk.get("usage") or {}
                details = usage.get("prompt_tokens_details") or {}
                cached = details.get("cached_tokens", cached)
        return times, cached

    async def prefill(self, length: int, fraction: float, chunk: int) -> PrefillSample:
        prompt = self.prompt(length)
        prefix = int(length * fraction)
        if prefix:
            await self.stream(prompt[:prefix], 1)  # now cached, as far as whole blocks go
        start = time.perf_counter()
        times, cached = await self.stream(prompt, 1)
        if cached is None and prefix:
            raise ValueError(
                f"{self.url} reports no cached tokens in its usage, so what it found cached "
                "is unknown: start vLLM with --enable-prompt-tokens-details, or give "
                "--cached-fractions 0"
            )
        return PrefillSample(length, cached or 0, chunk, times[0] - start)

    async def decode(self, seqs: int, context: int, tokens: int) -> DecodeSample:
        """``seqs`` requests at once; the median gap between tokens while all decode."""
        streams = await asyncio.gather(
            *(self.stream(self.prompt(context), tokens) for _ in range(seqs))
        )
        arrivals = [times for times, _ in streams]
        begin = max(times[1] for times in arrivals)  # every sequence past its prefill
        end = min(times[-1] for times in arrivals)
        gaps = [
            later - earlier
            for times in arrivals
            for earlier, later in itertools.pairwise(times[1:])
            if begin <= earlier and later <= end
        ]
        if not gaps:
            raise ValueError(f"{seqs} sequences never decoded together: raise --decode-tokens")
        mean_context = seqs * (context + tokens / 2)
        return DecodeSample(seqs, int(mean_context), float(np.median(gaps)))


def sweep(config: CalibrateConfig, kv_tokens: int | None = None) -> list[tuple[str, Any]]:
    """Every measurement of the sweep, as (kind, arguments), leaving out the batches
    whose KV would not fit in ``kv_tokens`` (the engine would queue or preempt them)."""
    limit = KV_USE * kv_tokens if kv_tokens else float("inf")
    fits = [
        (b, c)
        for b in config.batch_sizes
        for c in config.decode_contexts
        if b * (c + config.decode_tokens) <= limit
    ]
    if len({b for b, _ in fits}) < 2:
        raise ValueError(
            f"the server holds {kv_tokens:,} tokens of KV: too few for two of the "
            "--batch-sizes at any of the --decode-contexts; give smaller ones"
        )
    points: list[tuple[str, Any]] = []
    for _ in range(config.repeats):
        points += [
            ("prefill", (n, f, config.chunk_tokens))
            for n in config.prompt_lengths
            for f in config.cached_fractions
        ]
        points += [("decode", (b, c, config.decode_tokens)) for b, c in fits]
    return points


@dataclass(frozen=True)
class Calibration:
    fit: Fit
    profile: CostProfile


async def calibrate(
    config: CalibrateConfig, progress: bool = True, fleet_token: str = ""
) -> Calibration:
    """Time the server over the sweep and fit the profile (``fleet_token``: what the
    server asks of callers, if it is one of a fleet's replicas)."""
    timeout = aiohttp.ClientTimeout(total=600)
    headers = bearer(fleet_token)
    async with aiohttp.ClientSession(timeout=timeout, headers=headers) as session:
        card = await describe(session, config.backend)
        model = config.model or (card.model if card else "")
        model = model or await _first_model(session, config.backend)
        kv_tokens = _kv_tokens(card)
        kv_bytes = await _kv_bytes_per_token(session, config.backend, kv_tokens)
        points = sweep(config, kv_tokens)
        if len(points) < len(sweep(config)):
            print(
                f"calibrate: decode batches left out: their KV would not fit in the "
                f"{kv_tokens:,} tokens the server holds",
                file=sys.stderr,
            )
        server = Server(session, config.backend, model, config.seed)
        await server.stream(server.prompt(16), 2)  # the first request warms the server up
        samples = [
            await (server.prefill(*args) if kind == "prefill" else server.decode(*args))
            for kind, args in tqdm(points, desc="calibrate", unit="sample", disable=not progress)
        ]
    fitted = fit(_medians(samples))
    base = get_profile(config.base_profile)
    profile = replace(
        base,
        name=f"calibrated-{model}",
        costs=fitted.costs,
        kv_tokens=kv_tokens,
        kv_bytes_per_token=kv_bytes or base.kv_bytes_per_token,
        host_memory_bytes=0.0,  # no host tier unless asked for (--host-blocks)
        request_s=fitted.request_s,
    )
    return Calibration(fitted, profile)


def _kv_tokens(card: EngineCard | None) -> int | None:
    """The tokens of KV the server says it holds, if it says."""
    if card is None or card.num_blocks is None or card.block_size is None:
        return None
    return card.num_blocks * card.block_size


async def _kv_bytes_per_token(
    session: aiohttp.ClientSession, url: str, kv_tokens: int | None
) -> int | None:
    """A vLLM server's KV bytes per token, from the pool's size in its ``/metrics``."""
    async with session.get(f"{url}/metrics") as response:
        text = await response.text() if response.status == 200 else ""
    pool = vllm_cache_config(text).get("kv_cache_memory_bytes", "")
    return int(pool) // kv_tokens if pool.isdigit() and kv_tokens else None


async def _first_model(session: aiohttp.ClientSession, url: str) -> str:
    async with session.get(f"{url}/v1/models") as response:
        if response.status != 200:
            raise ValueError(
                f"{url}/v1/models answered {response.status}: name the model with --model"
            )
        return str((await response.json())["data"][0]["id"])


def _medians(samples: Sequence[Sample]) -> list[Sample]:
    """One sample per point of the sweep: the median of its repeats."""
    groups: dict[tuple, list[Sample]] = {}
    for s in samples:
        key = (type(s), *[v for k, v in asdict(s).items() if k not in ("ttft_s", "itl_s")])
        groups.setdefault(key, []).append(s)
    merged: list[Sample] = []
    for group in groups.values():
        median = float(np.median([s.measured_s for s in group]))
        first = group[0]
        merged.append(
            replace(first, ttft_s=median)
            if isinstance(first, PrefillSample)
            else replace(first, itl_s=median)
        )
    return merged


def report(result: Calibration) -> str:
    """The fitted terms and the residuals, as Markdown."""
    f = result.fit
    values = dict(zip(TERMS, f.terms(), strict=True))
    meaning = {
        "request_s": "per request, outside steps (HTTP, tokenizing, scheduling)",
        "step_s": "per engine step",
        "seq_s": "per sequence in a step (with its LM head)",
        "token_s": "per token through the linear layers",
        "attention_pair_s": "per (query, key) pair of attention",
    }
    lines = ["| term | fitted | what it is |", "|---|---:|---|"]
    lines += [f"| {t} | {_seconds(values[t])} | {meaning[t]} |" for t in TERMS]
    kv = result.profile.kv_tokens
    capacity = f"{kv:,} tokens, as the server reports" if kv else "not reported"
    lines += [
        "",
        f"Residuals over {len(f.samples)} points (|fitted / measured - 1|): "
        f"median {f.median_residual:.1%}, worst {f.worst_residual:.1%}.",
        f"KV capacity: {capacity}.",
    ]
    return "\n".join(lines)


def samples_table(result: Calibration) -> str:
    """Every point of the sweep: what it measured, what the fit says, the residual."""
    lines = ["| sample | measured | fitted | residual |", "|---|---:|---:|---:|"]
    for sample, residual in zip(result.fit.samples, result.fit.residuals(), strict=True):
        if isinstance(sample, PrefillSample):
            what = f"prefill {sample.prompt} tokens, {sample.cached} cached"
        else:
            what = f"decode {sample.seqs} sequences, {sample.context:,} tokens of context"
        fitted = result.fit.predicted_s(sample)
        lines.append(
            f"| {what} | {_seconds(sample.measured_s)} | {_seconds(fitted)} | {residual:+.1%} |"
        )
    return "\n".join(lines)


def _seconds(value: float) -> str:
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6), ("ns", 1e-9)):
        if value >= scale:
            return f"{value / scale:.3g} {unit}"
    return f"{value / 1e-9:.3g} ns"


def chart(result: Calibration, path: Path) -> None:
    """Measured against fitted time, one point per sample: on the diagonal is a perfect fit."""
    figure, axes = plt.subplots(figsize=(6, 5))
    for kind, label in (
        (PrefillSample, "time to first token, alone"),
        (DecodeSample, "decode step"),
    ):
        chosen = [s for s in result.fit.samples if isinstance(s, kind)]
        axes.scatter(
            [s.measured_s * 1e3 for s in chosen],
            [result.fit.predicted_s(s) * 1e3 for s in chosen],
            label=label,
            s=18,
        )
    times = [s.measured_s * 1e3 for s in result.fit.samples]
    line = [min(times) / 1.2, max(times) * 1.2]
    axes.plot(line, line, color="grey", linewidth=0.8)
    axes.set(
        xscale="log",
        yscale="log",
        xlabel="measured (ms)",
        ylabel="fitted (ms)",
        title=f"{result.profile.name}: measured against fitted",
    )
    axes.legend()
    save_figure(figure, path)


def add_calibrate_parser(commands: Any) -> None:
    parser: argparse.ArgumentParser = commands.add_parser(
        "calibrate",
        help="fit the cost model to a live engine and write a profile for --profile",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    defaults = CalibrateConfig("http://-")
    parser.add_argument("--backend", required=True, metavar="URL", help="the server to time")
    parser.add_argument("--model", help="default: the server's first model")
    for name, kind in (
        ("prompt_lengths", int),
        ("cached_fractions", float),
        ("batch_sizes", int),
        ("decode_contexts", int),
    ):
        default = ",".join(str(v) for v in getattr(defaults, name))
        parser.add_argument(
            f"--{name.replace('_', '-')}",
            default=default,
            type=_list_of(kind),
            help=f"comma-separated; default: {default}",
        )
    for name in ("decode_tokens", "repeats", "chunk_tokens", "seed"):
        parser.add_argument(
            f"--{name.replace('_', '-')}",
            type=int,
            default=getattr(defaults, name),
            help=f"default: {getattr(defaults, name)}",
        )
    parser.add_argument(
        "--base-profile",
        default=defaults.base_profile,
        help="where the profile's KV bytes per token come from",
    )
    parser.add_argument(
        "--out",
        metavar="DIR",
        default="reports/calibrate",
        help="profile.json, calibration.md, calibration.png",
    )
    parser.add_argument(
        "--fleet-token-file",
        default="",
        metavar="FILE",
        help="a fleet's replica: the token it asks of callers, in a file; "
        "default: $PREFIX_ROUTER_FLEET_TOKEN",
    )
    parser.add_argument("--no-progress", action="store_true")
    parser.set_defaults(run=run_calibrate)


def _list_of(kind: type) -> Callable[[str], tuple]:
    def parse(text: str) -> tuple:
        return tuple(kind(value) for value in text.split(",") if value)

    return parse


def run_calibrate(args: argparse.Namespace) -> int:
    config = CalibrateConfig(
        args.backend.rstrip("/"),
        args.model,
        args.prompt_lengths,
        args.cached_fractions,
        args.batch_sizes,
        args.decode_contexts,
        args.decode_tokens,
        args.repeats,
        args.chunk_tokens,
        args.base_profile,
        args.seed,
    )
    try:
        token = fleet_token(args.fleet_token_file)
        result = asyncio.run(calibrate(config, not args.no_progress, token))
    except aiohttp.ClientError as error:
        raise ValueError(f"cannot reach {config.backend} ({error}): is it running?") from None
    print(report(result))
    out = write_calibration(result, config.backend, Path(args.out))
    print(f"wrote {out}: give it as --profile {out}", file=sys.stderr)
    return 0


def write_calibration(result: Calibration, backend: str, out: Path) -> Path:
    """``profile.json``, ``calibration.md`` (every point measured and fitted) and
    ``calibration.png`` in ``out``; the profile's path."""
    out.mkdir(parents=True, exist_ok=True)
    result.profile.save(out / "profile.json")
    (out / "calibration.md").write_text(
        f"# prefix-router calibrate {backend}\n\n{report(result)}\n\n{samples_table(result)}\n\n"
        "![measured against fitted](calibration.png)\n"
    )
    chart(result, out / "calibration.png")
    return out / "profile.json"
