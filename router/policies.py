"""Routing policies, chosen by name from a registry.

A policy is a small class: ``choose(request, replicas)`` returns one of the
replicas, and ``on_dispatch`` / ``on_complete`` let it keep its own state. The
clock and the random generator are passed in, never global.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np


@dataclass
class ReplicaState:
    """What the router knows of one replica; load is counted at dispatch and completion."""

    replica_id: str
    capacity_blocks: int = 0
    outstanding_requests: int = 0
    outstanding_prefill_tokens: int = 0
    dispatched: int = 0


@dataclass(frozen=True)
class RoutingRequest:
    """A request as the router sees it: its length and its leading block identities."""

    request_id: str
    num_prompt_tokens: int
    block_hashes: Sequence[int] = field(default=(), repr=False)


class Policy:
    """Base class: subclasses set ``name`` and implement ``choose``."""

    name: ClassVar[str] = ""

    def __init__(self, clock: Callable[[], float], rng: np.random.Generator) -> None:
        self.clock = clock
        self.rng = rng

    def choose(self, request: RoutingRequest, replicas: Sequence[ReplicaState]) -> ReplicaState:
        raise NotImplementedError

    def on_dispatch(self, request: RoutingRequest, replica: ReplicaState) -> None:
        """Called once the request is sent to ``replica``."""

    def on_complete(self, request: RoutingRequest, replica: ReplicaState) -> None:
        """Called when the request ends, whether it finished, failed or was aborted."""


class RoundRobin(Policy):
    """Each replica in turn, blind to cache and load: the baseline to beat."""

    name = "round_robin"

    def __init__(self, clock: Callable[[], float], rng: np.random.Generator) -> None:
        super().__init__(clock, rng)
        self._next = 0

    def choose(self, request: RoutingRequest, replicas: Sequence[ReplicaState]) -> ReplicaState:
        replica = replicas[self._next % len(replicas)]
        self._next += 1
        return replica


POLICIES: dict[str, type[Policy]] = {cls.name: cls for cls in (RoundRobin,)}


def make_policy(name: str, clock: Callable[[], float], rng: np.random.Generator) -> Policy:
    try:
        return POLICIES[name](clock, rng)
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; known: {', '.join(POLICIES)}") from None
