"""Seeded request generators shared by the offline replayer and the Locust users.

A workload is a list of sessions. A session is a list of turns played in order: the
next turn is sent ``think_time_s`` after the previous one completes, and each turn's
prompt resends the whole conversation so far. How sessions start is the workload's
``arrival`` mode: ``poisson`` (open loop: sessions start at the given times),
``closed`` (``num_users`` users each play one session after another) or ``trace``
(every request at its recorded timestamp, no waiting on completions).

The same name, parameters and seed always give the same requests.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields, replace
from functools import cached_property, lru_cache, partial
from pathlib import Path
from typing import Any, Literal

import numpy as np

from replica.api.tokenizer import TOKEN_DTYPE, ByteTokenizer, Message, Tokenizer
from router.fair.fairness import PRIORITIES, priority_rank

ArrivalMode = Literal["poisson", "closed", "trace"]
ARRIVAL_MODES: tuple[ArrivalMode, ...] = ("poisson", "closed", "trace")
RATE_SHAPES = ("flat", "day")


@dataclass(frozen=True, eq=False)
class Turn:
    """One request. ``messages`` is set for chat workloads, ``None`` for token traces."""

    build_prompt: Callable[[], np.ndarray] = field(repr=False)
    max_tokens: int
    think_time_s: float = 0.0
    messages: tuple[Message, ...] | None = field(default=None, repr=False)
    timestamp_s: float | None = None

    @cached_property
    def prompt_token_ids(self) -> np.ndarray:
        return self.build_prompt()

    def forget_prompt(self) -> None:
        """Drop the materialised prompt (traces are too large to keep all of them)."""
        self.__dict__.pop("prompt_token_ids", None)


@dataclass(frozen=True)
class Session:
    session_id: str
    start_time_s: float
    turns: tuple[Turn, ...]
    app: int = 0
    #: Token ranges ``[0, n)`` of the prompt shared across sessions (the system prompt).
    shared_prefix_tokens: int = 0
    #: The tenant's cache salt: its blocks never share an identity with another tenant's.
    cache_salt: str | None = None
    #: The model it asks for (``None``: the fleet's only one) and the LoRA adapter on it.
    model: str | None = None
    adapter: str | None = None
    #: Who sends it (``None``: no tenants), and its requests' class's rank (0:
    #: interactive, 1: batch; router/fair/fairness.py).
    tenant: str | None = None
    priority: int = 0

    @property
    def served_name(self) -> str | None:
        """What its requests name as ``model``: the adapter, else the model."""
        return self.adapter or self.model


@dataclass(frozen=True)
class Workload:
    name: str
    sessions: tuple[Session, ...]
    arrival: ArrivalMode = "poisson"
    num_users: int = 0

    @property
    def num_requests(self) -> int:
        return sum(len(s.turns) for s in self.sessions)


# ----------------------------------------------------------------------- chat


@dataclass(frozen=True)
class ChatConfig:
    """A chat service: applications with long system prompts, multi-turn sessions.

    Defaults follow the seed chapter's picture of a chat endpoint (a 1,500-token
    system prompt, short user questions, every turn resending the history) at a
    scale one replica of ``capacity_blocks`` 2048 cannot hold all at once.
    """

    #: Applications, each with its own system prompt: a fleet serves several products.
    num_apps: int = 4
    #: Zipf exponent of application popularity: a few apps take most traffic.
    app_skew: float = 1.0
    #: The seed chapter's system prompt length.
    system_prompt_tokens: int = 1500
    #: Few-shot examples after the system prompt, shared by an app's sessions.
    fewshot_tokens: int = 0
    #: Chance a session opens with a retrieved document (RAG), unique to the session.
    document_probability: float = 0.0
    document_tokens: int = 1000
    #: Sessions in the run and their mean length in turns (geometric, like real chats
    #: where most sessions are short and a few run long).
    num_sessions: int = 400
    mean_turns: float = 4.0
    max_turns: int = 12
    #: Mean user question and reply lengths (lognormal; sigma 0.5).
    user_tokens: int = 60
    reply_tokens: int = 250
    #: Mean pause between a reply and the next question (exponential).
    think_time_s: float = 8.0
    arrival: ArrivalMode = "poisson"
    #: Sessions started per second (poisson arrival): its mean over the run.
    session_rate: float = 2.0
    #: How the rate moves over the run: ``flat``, or ``day`` (a day's shape: it rises
    #: from a quarter of its peak at the start to the peak halfway, and falls again).
    rate_shape: str = "flat"
    #: Concurrent users (closed arrival).
    num_users: int = 32
    #: A fleet of several models: the models sessions ask for, comma-separated, spread
    #: evenly (empty: the fleet's one model, named by no request); on the first of them,
    #: ``adapters`` LoRA adapters (``MODEL-lora-K``), asked for by ``adapter_share`` of
    #: its sessions with Zipf popularity of exponent ``adapter_skew``.
    models: str = ""
    adapters: int = 0
    adapter_share: float = 0.75
    adapter_skew: float = 1.0
    #: Tenants sharing the fleet, ``NAME=RATE[:batch],...``: each plays a chat service of
    #: its own (its own system prompts, its cache salted apart) at RATE times
    #: ``session_rate``, with as many times ``num_sessions``, in the ``interactive``
    #: class unless marked ``batch``; empty: one service and no tenants.
    tenants: str = ""
    seed: int = 0

    def __post_init__(self) -> None:
        if self.num_apps < 1 or self.num_sessions < 1:
            raise ValueError("num_apps and num_sessions must be positive")
        if self.arrival not in ("poisson", "closed"):
            raise ValueError(f"chat arrival must be poisson or closed, got {self.arrival!r}")
        if not 0 <= self.document_probability <= 1:
            raise ValueError("document_probability must lie in [0, 1]")
        if self.mean_turns < 1 or self.max_turns < 1:
            raise ValueError("mean_turns and max_turns must be at least 1")
        if self.rate_shape not in RATE_SHAPES:
            raise ValueError(
                f"unknown rate_shape {self.rate_shape!r}; known: {', '.join(RATE_SHAPES)}"
            )
        if self.session_rate <= 0 or self.think_time_s < 0:
            raise ValueError("session_rate must be positive and think_time_s not negative")
        if self.adapters < 0 or not 0 <= self.adapter_share <= 1:
            raise ValueError("adapters must not be negative and adapter_share lie in [0, 1]")
        if self.adapters and not self.model_names:
            raise ValueError("adapters need a model to sit on: give models")
        _ = self.tenant_specs  # checks them

    @property
    def tenant_specs(self) -> tuple[tuple[str, float, int], ...]:
        """Each tenant's name, rate multiplier and class rank."""
        specs = []
        for entry in filter(None, (e.strip() for e in self.tenants.split(","))):
            name, _, rest = entry.partition("=")
            rate, _, kind = rest.partition(":")
            try:
                multiplier, rank = float(rate), priority_rank(kind or PRIORITIES[0])
            except ValueError:
                multiplier, rank = 0.0, -1
            if not name or multiplier <= 0 or rank < 0:
                raise ValueError(
                    f"bad tenant {entry!r}: expected NAME=RATE or NAME=RATE:batch, RATE > 0"
                )
            specs.append((name, multiplier, rank))
        return tuple(specs)

    @property
    def model_names(self) -> tuple[str, ...]:
        return tuple(name for name in self.models.split(",") if name)

    @property
    def adapter_names(self) -> tuple[str, ...]:
        base = self.model_names[0] if self.model_names else ""
        return tuple(f"{base}-lora-{k}" for k in range(self.adapters))


_WORDS = tuple(f"{a}{v}{b} " for a in "bdfgklmnprstvz" for v in "aeiou" for b in "lmnrst")


def _text(rng: np.random.Generator, num_tokens: int) -> str:
    """Random words of exactly ``num_tokens`` 4-byte tokens."""
    return "".join(_WORDS[i] for i in rng.integers(0, len(_WORDS), max(num_tokens, 1)))


def _lognormal(rng: np.random.Generator, mean: int) -> int:
    return max(1, int(rng.lognormal(np.log(mean) - 0.125, 0.5)))


def chat_workload(config: ChatConfig | None = None) -> Workload:
    config = config or ChatConfig()
    if config.tenants:
        return _tenants_workload(config)
    rng = np.random.default_rng(config.seed)
    apps = [_app_prefix(rng, config, app) for app in range(config.num_apps)]
    popularity = 1.0 / np.arange(1, config.num_apps + 1) ** config.app_skew
    app_of_session = rng.choice(
        config.num_apps, config.num_sessions, p=popularity / popularity.sum()
    )
    gaps = rng.exponential(1.0 / config.session_rate, config.num_sessions)
    starts = np.cumsum(gaps) - gaps[0]
    if config.rate_shape == "day":
        starts = day_shaped(starts)
    tokenizer = ByteTokenizer()
    sessions = tuple(
        _chat_session(rng, config, tokenizer, index, int(app), apps[app], float(start))
        for index, (app, start) in enumerate(zip(app_of_session, starts, strict=True))
    )
    if config.model_names:
        sessions = _with_models(sessions, config)
    return Workload("chat", sessions, config.arrival, config.num_users)


def day_shaped(starts: np.ndarray) -> np.ndarray:
    """Arrival times of a flat Poisson process, moved so that the rate follows a day:
    ``peak x (1 - 0.75 cos^2(pi t / T))`` over the run's length T, a quarter of the
    peak at either end and the peak halfway, with the same mean (the process's time
    changed by the inverse of its cumulative rate, so arrivals stay Poisson)."""
    if len(starts) < 2:
        return starts
    end = float(starts[-1])
    grid = np.linspace(0.0, end, 4097)
    shape = 1.0 - 0.75 * np.cos(np.pi * grid / end) ** 2
    cumulative = np.concatenate(([0.0], np.cumsum((shape[1:] + shape[:-1]) / 2 * np.diff(grid))))
    return np.interp(starts, cumulative * end / cumulative[-1], grid)


def _tenants_workload(config: ChatConfig) -> Workload:
    """Every tenant's own chat service, played at once, its sessions in start order."""
    sessions: list[Session] = []
    for index, (name, multiplier, rank) in enumerate(config.tenant_specs):
        own = replace(
            config,
            tenants="",
            session_rate=config.session_rate * multiplier,
            num_sessions=max(1, round(config.num_sessions * multiplier)),
            seed=config.seed * 1_000 + index + 1,  # its own system prompts and users
        )
        for session in chat_workload(own).sessions:
            sessions.append(
                replace(
                    session,
                    session_id=f"{name}/{session.session_id}",
                    cache_salt=name,
                    tenant=name,
                    priority=rank,
                )
            )
    sessions.sort(key=lambda s: s.start_time_s)
    return Workload("chat", tuple(sessions), config.arrival, config.num_users)


def _with_models(sessions: tuple[Session, ...], config: ChatConfig) -> tuple[Session, ...]:
    """Each session's model (evenly, in turn) and, on the first model, its adapter,
    drawn apart from the prompts (a fleet of one model replays the same prompts)."""
    rng = np.random.default_rng([config.seed, 7])
    models, adapters = config.model_names, config.adapter_names
    popularity = 1.0 / np.arange(1, len(adapters) + 1) ** config.adapter_skew
    named = []
    for index, session in enumerate(sessions):
        model = models[index % len(models)]
        adapter = None
        if adapters and model == models[0] and rng.random() < config.adapter_share:
            adapter = adapters[int(rng.choice(len(adapters), p=popularity / popularity.sum()))]
        named.append(replace(session, model=model, adapter=adapter))
    return tuple(named)


def _app_prefix(rng: np.random.Generator, config: ChatConfig, app: int) -> tuple[Message, ...]:
    messages: tuple[Message, ...] = (
        {"role": "system", "content": f"App {app}. " + _text(rng, config.system_prompt_tokens - 2)},
    )
    if config.fewshot_tokens:
        half = config.fewshot_tokens // 2
        messages += (
            {"role": "user", "content": _text(rng, half)},
            {"role": "assistant", "content": _text(rng, half)},
        )
    return messages


def _chat_session(
    rng: np.random.Generator,
    config: ChatConfig,
    tokenizer: ByteTokenizer,
    index: int,
    app: int,
    prefix: tuple[Message, ...],
    start: float,
) -> Session:
    num_turns = min(int(rng.geometric(1.0 / config.mean_turns)), config.max_turns)
    history = prefix
    shared = len(tokenizer.apply_chat_template(prefix, add_generation_prompt=False))
    opening = ""
    if rng.random() < config.document_probability:
        opening = "Document: " + _text(rng, config.document_tokens) + "\n"
    turns = []
    for turn in range(num_turns):
        question = {
            "role": "user",
            "content": opening + _text(rng, _lognormal(rng, config.user_tokens)),
        }
        opening = ""
        messages = (*history, question)
        reply_len = _lognormal(rng, config.reply_tokens)
        think = float(rng.exponential(config.think_time_s)) if turn else 0.0
        turns.append(Turn(_chat_prompt(tokenizer, messages), reply_len, think, messages))
        history = (*messages, {"role": "assistant", "content": _text(rng, reply_len)})
    return Session(f"chat-{index}", start, tuple(turns), app, shared)


def _chat_prompt(tokenizer: Tokenizer, messages: tuple[Message, ...]) -> Callable[[], np.ndarray]:
    return lambda: tokenizer.apply_chat_template(messages)


def retokenized(workload: Workload, tokenizer: Tokenizer) -> Workload:
    """The workload's chat turns as an engine with ``tokenizer`` (and its chat template)
    reads them, so that a replay of a real model's fleet counts its tokens; turns
    without messages (token traces) stay as they are."""
    sessions = []
    for session in workload.sessions:
        turns = tuple(
            replace(turn, build_prompt=_chat_prompt(tokenizer, turn.messages))
            if turn.messages is not None
            else turn
            for turn in session.turns
        )
        first = session.turns[0].messages if session.turns else None
        shared = session.shared_prefix_tokens
        if first is not None:  # the app's messages: every turn's but the first question
            shared = len(tokenizer.apply_chat_template(first[:-1], add_generation_prompt=False))
        sessions.append(replace(session, turns=turns, shared_prefix_tokens=shared))
    return replace(workload, sessions=tuple(sessions))


# ---------------------------------------------------------------------- traces

TRACE_BLOCK_TOKENS = 512  # Mooncake's hash ids each stand for 512 tokens


@lru_cache(maxsize=1 << 16)
def trace_block_tokens(hash_id: int, num_tokens: int = TRACE_BLOCK_TOKENS) -> np.ndarray:
    """The deterministic token ids of one trace hash id (a SplitMix64 stream); read-only."""
    x = np.arange(num_tokens, dtype=np.uint64) + np.uint64(hash_id) * np.uint64(TRACE_BLOCK_TOKENS)
    with np.errstate(over="ignore"):
        x = (x + np.uint64(0x9E3779B97F4A7C15)) * np.uint64(0xBF58476D1CE4E5B9)
        x ^= x >> np.uint64(31)
        x *= np.uint64(0x94D049BB133111EB)
        x ^= x >> np.uint64(29)
    tokens = (x & np.uint64(0xFFFFFFFF)).astype(TOKEN_DTYPE)
    tokens.flags.writeable = False  # shared by every prompt that holds this hash id
    return tokens


def trace_prompt(hash_ids: Sequence[int], input_length: int) -> np.ndarray:
    blocks = [trace_block_tokens(h) for h in hash_ids]
    tokens = np.concatenate(blocks) if blocks else np.empty(0, TOKEN_DTYPE)
    if len(tokens) < input_length:  # a trace may claim more tokens than its ids cover
        tokens = np.concatenate(
            (tokens, trace_block_tokens(-1 - len(tokens), input_length - len(tokens)))
        )
    return tokens[:input_length]


def trace_workload(
    path: str | Path,
    limit: int | None = None,
    time_scale: float = 1.0,
    copies: int = 1,
    copy_shift_s: float = 60.0,
) -> Workload:
    """A Mooncake-format JSONL trace: one request per line, at its timestamp (ms).

    ``copies`` > 1 scales it for a larger fleet: copy k replays the trace as tenant
    ``copy-k`` (a cache salt of its own, so no copy shares a block with another) and
    ``k * copy_shift_s / copies`` seconds later, so the copies interleave.
    """
    if copies < 1 or copy_shift_s < 0:
        raise ValueError("copies must be positive and copy_shift_s not negative")
    sessions = []
    with open(path, encoding="utf-8") as lines:
        for index, line in enumerate(lines):
            if limit is not None and index >= limit:
                break
            hash_ids, length, start_ms, output = _trace_record(path, index + 1, line)
            start = start_ms / 1000.0 * time_scale
            turn = Turn(partial(trace_prompt, hash_ids, length), max(1, output), timestamp_s=start)
            sessions.append(Session(f"trace-{index}", start, (turn,), 0, TRACE_BLOCK_TOKENS))
    original = tuple(sessions)
    for copy in range(1, copies):
        shift = copy * copy_shift_s / copies
        sessions += [_shifted(session, shift, f"copy-{copy}") for session in original]
    name = f"trace:{path}" + (f" x{copies}" if copies > 1 else "")
    return Workload(name, tuple(sessions), "trace")


#: A Mooncake trace line's fields (../shared/traces/README.md).
TRACE_FIELDS = ("timestamp", "input_length", "output_length", "hash_ids")


def _trace_record(
    path: str | Path, number: int, line: str
) -> tuple[tuple[int, ...], int, float, int]:
    """One trace line's hash ids, input length, timestamp (ms) and output length; a line
    that is not one is an error naming the file, the line and what is wrong."""
    where = f"{path}, line {number}"
    try:
        record = json.loads(line)
    except json.JSONDecodeError as error:
        raise ValueError(f"{where}: not JSON ({error.msg})") from None
    missing = [name for name in TRACE_FIELDS if not isinstance(record, dict) or name not in record]
    if missing:
        raise ValueError(f"{where}: a Mooncake trace line needs {', '.join(TRACE_FIELDS)}; "
                         f"missing {', '.join(missing)}")  # fmt: skip
    try:
        return (tuple(int(h) for h in record["hash_ids"]), int(record["input_length"]),
                float(record["timestamp"]), int(record["output_length"]))  # fmt: skip
    except (TypeError, ValueError):
        raise ValueError(
            f"{where}: timestamp, input_length and output_length must be "
            "numbers and hash_ids a list of integers"
        ) from None


def _shifted(session: Session, shift_s: float, tenant: str) -> Session:
    """``session`` as ``tenant`` plays it, ``shift_s`` later."""
    turns = tuple(
        replace(turn, timestamp_s=(turn.timestamp_s or 0.0) + shift_s) for turn in session.turns
    )
    return replace(
        session,
        session_id=f"{tenant}/{session.session_id}",
        start_time_s=session.start_time_s + shift_s,
        turns=turns,
        cache_salt=tenant,
    )


# --------------------------------------------------------------------- by name


def load_workload(spec: str, overrides: dict[str, Any] | None = None) -> Workload:
    """``chat`` (with ChatConfig overrides) or ``trace:PATH`` (with ``limit``)."""
    overrides = dict(overrides or {})
    if spec == "chat":
        known = {f.name for f in fields(ChatConfig)}
        unknown = set(overrides) - known
        if unknown:
            raise ValueError(f"unknown chat parameters {sorted(unknown)}; known: {sorted(known)}")
        return chat_workload(replace(ChatConfig(), **overrides))
    if spec.startswith("trace:"):
        path = spec.removeprefix("trace:")
        if not Path(path).is_file():
            raise ValueError(f"trace file {path!r} not found")
        known = {"limit", "time_scale", "copies", "copy_shift_s"}
        unknown = set(overrides) - known
        if unknown:
            raise ValueError(f"unknown trace parameters {sorted(unknown)}; known: {sorted(known)}")
        return trace_workload(path, **overrides)
    raise ValueError(f"unknown workload {spec!r}; expected 'chat' or 'trace:PATH'")
