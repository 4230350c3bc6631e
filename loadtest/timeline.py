"""One bench run over time: what the live dashboard shows while it runs, kept for the
report's charts.

Two sources, one clock (wall time, as two processes share no monotonic one): the
bench samples every replica's ``/stats`` about once a second (outstanding requests,
cache occupancy), and the Locust client records each answer (start, TTFT, prompt and
cached tokens). Windows of the answers give hit rate and TTFT over time.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from replica.api.stats import ReplicaStats

#: Width of the windows that hit rate and TTFT are computed over.
WINDOW_S = 10.0


@dataclass(frozen=True)
class Answer:
    """One streamed answer as the client saw it."""

    start: float  # wall time the request left
    ttft_s: float
    prompt_tokens: int
    cached_tokens: int


@dataclass
class Timeline:
    """A run's samples: per replica (in the fleet's order), outstanding requests at the
    replica (running + waiting), the share of its blocks holding cached KV, and the
    share pinned by running requests; and the client's answers."""

    start: float
    times: list[float] = field(default_factory=list)
    outstanding: list[list[int]] = field(default_factory=list)
    cached: list[list[float]] = field(default_factory=list)
    in_use: list[list[float]] = field(default_factory=list)
    answers: list[Answer] = field(default_factory=list)

    def sample(self, now: float, replicas: Sequence[ReplicaStats]) -> None:
        """Record the replicas' figures at wall time ``now`` (skipped if one is missing,
        so every sample has a value for every replica)."""
        if not replicas:
            return
        self.times.append(now)
        self.outstanding.append([r.running + r.waiting for r in replicas])
        self.cached.append([r.cache.cached_blocks / r.cache.num_blocks for r in replicas])
        self.in_use.append([r.cache.usage for r in replicas])

    def add_answers(self, records: Sequence[Sequence[float]]) -> None:
        """The client's ``answers`` (start, TTFT, prompt tokens, cached tokens)."""
        self.answers.extend(Answer(s, t, int(p), int(c)) for s, t, p, c in records)

    def seconds(self) -> np.ndarray:
        return np.asarray(self.times) - self.start

    def windows(self, width_s: float = WINDOW_S) -> list[tuple[float, list[Answer]]]:
        """The answers grouped by the window their request started in, by window middle."""
        if not self.answers:
            return []
        last = max(a.start for a in self.answers) - self.start
        groups: list[list[Answer]] = [[] for _ in range(int(last // width_s) + 1)]
        for answer in self.answers:
            groups[max(int((answer.start - self.start) // width_s), 0)].append(answer)
        return [((i + 0.5) * width_s, group) for i, group in enumerate(groups) if group]

    def hit_rate(self) -> tuple[list[float], list[float]]:
        """Cached over prompt tokens of the answers in each window."""
        points = [
            (t, sum(a.cached_tokens for a in g) / prompt)
            for t, g in self.windows()
            if (prompt := sum(a.prompt_tokens for a in g))
        ]
        return [t for t, _ in points], [rate for _, rate in points]

    def ttft(self, q: float) -> tuple[list[float], list[float]]:
        """The ``q``-th percentile of TTFT in each window, seconds."""
        points = [(t, float(np.percentile([a.ttft_s for a in g], q))) for t, g in self.windows()]
        return [t for t, _ in points], [value for _, value in points]

    def as_dict(self) -> dict[str, Any]:
        return {
            "start": self.start,
            "times": self.times,
            "outstanding": self.outstanding,
            "cached": self.cached,
            "in_use": self.in_use,
            "answers": [
                [a.start, a.ttft_s, a.prompt_tokens, a.cached_tokens] for a in self.answers
            ],
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Timeline:
        timeline = cls(
            data["start"], data["times"], data["outstanding"], data["cached"], data["in_use"]
        )
        timeline.add_answers(data["answers"])
        return timeline
