"""The ``chat`` workload: seeded sessions of a chat service.

Applications with long system prompts, their popularity Zipf-skewed; sessions of a
geometric number of turns that resend their whole history; optionally few-shot
examples, retrieved documents, several models and LoRA adapters, several tenants, and
an arrival rate that follows a day. The same parameters and seed always give the
same requests.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from loadtest.workloads.base import (
    ArrivalMode,
    Session,
    Turn,
    Workload,
    WorkloadKind,
    WorkloadOptions,
    configured,
)
from replica.api.tokenizer import ByteTokenizer, Message, Tokenizer
from router.fair.fairness import PRIORITIES, priority_rank

RATE_SHAPES = ("flat", "day", "ramp")


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
    #: Documents' lengths drawn evenly from ``document_tokens`` to this (0: all
    #: ``document_tokens`` long): long documents beside short turns, as P/D serves.
    document_max_tokens: int = 0
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
    #: How the rate moves over the run: ``flat``, ``day`` (a day's shape: it rises from
    #: a quarter of its peak at the start to the peak halfway, and falls again), or
    #: ``ramp`` (it rises evenly from half its mean at the start to 1.5 times it).
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
        if self.document_max_tokens and self.document_max_tokens < self.document_tokens:
            raise ValueError("document_max_tokens must be 0 or at least document_tokens")
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
    elif config.rate_shape == "ramp":
        starts = ramp_shaped(starts)
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
    peak at either end and the peak halfway, with the same mean."""
    return _shaped(starts, lambda x: 1.0 - 0.75 * np.cos(np.pi * x) ** 2)


def ramp_shaped(starts: np.ndarray) -> np.ndarray:
    """Arrival times of a flat Poisson process, moved so that the rate rises evenly
    from half its mean at the start to 1.5 times it at the end: a load that ramps past
    what a fleet serves, as a capacity planner tries one."""
    return _shaped(starts, lambda x: 0.5 + x)


def _shaped(starts: np.ndarray, shape: Callable[[np.ndarray], np.ndarray]) -> np.ndarray:
    """``starts`` with the rate following ``shape`` of the run's fraction elapsed, with
    the same mean (the process's time changed by the inverse of its cumulative rate,
    so arrivals stay Poisson)."""
    if len(starts) < 2:
        return starts
    end = float(starts[-1])
    grid = np.linspace(0.0, end, 4097)
    rate = shape(grid / end)
    cumulative = np.concatenate(([0.0], np.cumsum((rate[1:] + rate[:-1]) / 2 * np.diff(grid))))
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
        length = config.document_tokens
        if config.document_max_tokens > length:
            length = int(rng.integers(length, config.document_max_tokens + 1))
        opening = "Document: " + _text(rng, length) + "\n"
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


class Chat(WorkloadKind):
    """``chat``: a chat service's sessions (ChatConfig). Its load may be given per
    replica, so that every fleet size runs at one engine's utilisation."""

    name = "chat"
    usage = "chat"
    parameters = ChatConfig
    chat = True

    def build(self, argument: str, overrides: Mapping[str, Any]) -> Workload:
        return chat_workload(configured(ChatConfig, overrides, self.name))

    def overrides(self, options: WorkloadOptions) -> dict[str, Any]:
        parameters = dict(options.chat)
        if options.sessions_per_replica is not None:
            parameters.setdefault("num_sessions", options.sessions_per_replica * options.replicas)
        if options.rate_per_replica is not None:
            parameters.setdefault("session_rate", options.rate_per_replica * options.replicas)
        parameters["seed"] = options.seed
        return parameters

    def scales_with_fleet(self, options: WorkloadOptions) -> bool:
        return options.sessions_per_replica is not None or options.rate_per_replica is not None
