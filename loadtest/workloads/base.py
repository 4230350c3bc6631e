"""What every workload is made of, and what every kind of workload answers.

A workload is a list of sessions. A session is a list of turns played in order: the
next turn is sent ``think_time_s`` after the previous one completes, and each turn's
prompt resends the whole conversation so far. How sessions start is the workload's
``arrival`` mode: ``poisson`` (open loop: sessions start at the given times),
``closed`` (``num_users`` users each play one session after another) or ``trace``
(every request at its recorded timestamp, no waiting on completions).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from functools import cached_property
from typing import Any, ClassVar, Literal, TypeVar

import numpy as np

from replica.api.tokenizer import Message

ArrivalMode = Literal["poisson", "closed", "trace"]
ARRIVAL_MODES: tuple[ArrivalMode, ...] = ("poisson", "closed", "trace")
T = TypeVar("T")


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


@dataclass(frozen=True)
class WorkloadOptions:
    """What a command says of the workload it plays; each kind takes what applies to
    it (a chat service its parameters, seed and load per replica; a trace its limit
    and copies) and leaves the rest."""

    seed: int = 0
    #: The chat service's parameters the user set (ChatConfig's fields, by name).
    chat: Mapping[str, Any] = field(default_factory=dict)
    #: Only the first ``limit`` requests (None: all).
    limit: int | None = None
    #: The fleet it is played on. A load given per replica grows with it (unless the
    #: chat parameters fix it); a trace is copied once per ``replicas_per_copy``
    #: replicas (None: once whatever the fleet), the copies spread over ``copy_shift_s``.
    replicas: int = 1
    sessions_per_replica: int | None = None
    rate_per_replica: float | None = None
    replicas_per_copy: int | None = None
    copy_shift_s: float = 60.0


class WorkloadKind(ABC):
    """A kind of workload, named by a spec's part before any colon (``chat``,
    ``trace:PATH``): how it is built, and what the commands that play it ask of it.
    A new kind is a module with its subclass and a line in the registry
    (``loadtest/workloads/__init__.py``)."""

    #: Its name, and a spec of it as help texts show it (``trace:PATH``: with an argument).
    name: ClassVar[str]
    usage: ClassVar[str]
    #: Its parameters, a frozen dataclass: what :meth:`build`'s overrides may set.
    parameters: ClassVar[type]
    #: Whether the chat service's flags (``--chat-*``, ChatConfig) shape it: its sessions
    #: then have a rate (Locust's ``--arrival-rate``), adapters and bench-sized replicas.
    chat: ClassVar[bool] = False
    #: The parameters it sets to its own defaults, which a command's lighter default
    #: load (the bench's) leaves as they are.
    defaults: ClassVar[Mapping[str, Any]] = {}

    @property
    def takes_argument(self) -> bool:
        return ":" in self.usage

    @abstractmethod
    def build(self, argument: str, overrides: Mapping[str, Any]) -> Workload:
        """The workload of ``argument`` (a spec's part after the colon) with
        ``overrides`` of its parameters; ``ValueError`` names what is wrong."""

    @abstractmethod
    def overrides(self, options: WorkloadOptions) -> dict[str, Any]:
        """Its parameters, from what a command said."""

    def scales_with_fleet(self, options: WorkloadOptions) -> bool:
        """Whether fleets of other sizes play other workloads (each built for its size)."""
        return False


def configured(cls: type[T], overrides: Mapping[str, Any], kind: str) -> T:
    """``cls`` with ``overrides`` of its fields, an unknown one refused by name."""
    known = {f.name for f in fields(cls)}  # type: ignore[arg-type]
    unknown = set(overrides) - known
    if unknown:
        raise ValueError(f"unknown {kind} parameters {sorted(unknown)}; known: {sorted(known)}")
    return cls(**overrides)
