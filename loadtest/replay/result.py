"""What a replay gives back: one record per request, and the run's result."""

from __future__ import annotations

from dataclasses import dataclass, field

from loadtest.replay.config import ReplayConfig
from replica.engine import Engine


@dataclass
class RequestRecord:
    """One request's fate, in virtual seconds."""

    request_id: str
    session: int
    turn: int
    replica: int
    arrival_s: float
    prompt_tokens: int
    first_token_s: float | None = None
    finish_s: float | None = None
    cached_tokens: int = 0
    output_tokens: int = 0
    error: str | None = None
    shared_prefix_tokens: int = 0
    predicted_cached_tokens: int | None = None
    #: The model it asked for (``None``: the fleet's one model) and its adapter.
    model: str | None = None
    adapter: str | None = None
    #: Who sent it and its class's rank; when it left its router's queue.
    tenant: str | None = None
    priority: int = 0
    dispatched_s: float = 0.0
    #: How its KV got to ``replica``: ``local`` (computed there), ``disaggregated``
    #: (prefilled on ``prefill_replica``, its first token there at ``prefilled_s``,
    #: then pulled) or ``pulled`` (its prefix pulled from a peer). ``cached_tokens`` are
    #: those its prefill found cached (a peer's pulled prefix among them); a pull that
    #: found less than planned (evicted, timed out) computed the rest: a fallback.
    path: str = "local"
    prefill_replica: int | None = None
    prefilled_s: float | None = None
    pull_fallback: bool = False
    #: Its inter-token latencies as (seconds, tokens) pairs: the tokens of a decode
    #: burst share its mean iteration.
    token_gaps: list[tuple[float, int]] = field(default_factory=list)
    last_token_s: float | None = None


@dataclass
class ReplayResult:
    """What one replay gives back: every request's record, the engines as they ended,
    and the fleet's history."""

    workload: str
    policy: str
    config: ReplayConfig
    records: list[RequestRecord]
    engines: list[Engine]
    duration_s: float
    shared_prefix_evictions: int = 0
    dispatched: list[int] = field(default_factory=list)
    #: The fleet's size (replicas held: serving, starting or stopping) from each time on.
    fleet_sizes: list[tuple[float, int]] = field(default_factory=list)
    #: (time, what, replica index): ``asked`` for, ``serving``, ``stopping`` (out of
    #: routing, finishing its requests), ``stopped``.
    scale_events: list[tuple[float, str, int]] = field(default_factory=list)
    #: (time, prefix key, set size) at every change of a hot prefix's replication set
    #: (``cache_aware_replicated``; the first router's).
    hot_set_changes: list[tuple[float, int, int]] = field(default_factory=list)
    #: A disaggregated fleet's pools' sizes, by role, as ``fleet_sizes``.
    pool_sizes: dict[str, list[tuple[float, int]]] = field(default_factory=dict)

    @property
    def replica_hours(self) -> float:
        """Replicas held, integrated over the run, in hours."""
        sizes = self.fleet_sizes or [(0.0, self.config.replicas)]
        ends = [t for t, _ in sizes[1:]] + [max(self.duration_s, sizes[-1][0])]
        return sum(n * (end - start) for (start, n), end in zip(sizes, ends, strict=True)) / 3600
