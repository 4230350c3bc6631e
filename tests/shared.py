"""Helpers and data the tests share (fixtures are in conftest.py)."""

from __future__ import annotations

from pathlib import Path

import httpx
import numpy as np

from replica.api import stats as stats_codec
from replica.api.stats import ReplicaStats
from replica.api.tokenizer import TOKEN_DTYPE
from router.stats import GatewayStats

#: The first 400 requests of ../shared/traces/mooncake_conversation.jsonl (see data/README.md).
MOONCAKE_TRACE = Path(__file__).resolve().parent / "data" / "mooncake_conversation_head.jsonl"


class FakeClock:
    """A clock the test moves by hand: ``clock.now += 5``."""

    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def prompt(length: int, start: int = 1) -> np.ndarray:
    """``length`` distinct token ids from ``start``: two prompts share exactly the
    tokens their ranges share (from 1: token 0 is the simulated model's EOS)."""
    return np.arange(start, start + length, dtype=TOKEN_DTYPE)


def gateway_stats(url: str) -> GatewayStats:
    return stats_codec.decode(GatewayStats, httpx.get(f"{url}/stats").content)


def replica_stats(url: str) -> ReplicaStats:
    return stats_codec.decode(ReplicaStats, httpx.get(f"{url}/stats").content)
