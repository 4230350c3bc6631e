"""The ``trace:PATH`` workload: a trace in Mooncake's format, replayed at its timestamps.

One JSON object per line: ``timestamp`` (ms from the start), ``input_length`` and
``output_length`` (tokens), ``hash_ids`` (the prompt's blocks of 512 tokens, equal ids
for equal content across requests). Each hash id gets 512 tokens of its own, so
requests that share ids share a prefix.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from functools import lru_cache, partial
from pathlib import Path
from typing import Any

import numpy as np

from loadtest.workloads.base import (
    Session,
    Turn,
    Workload,
    WorkloadKind,
    WorkloadOptions,
    configured,
)
from replica.api.tokenizer import TOKEN_DTYPE

TRACE_BLOCK_TOKENS = 512  # Mooncake's hash ids each stand for 512 tokens


@dataclass(frozen=True)
class TraceConfig:
    """How a trace is replayed: its first ``limit`` requests (None: all), its times
    scaled by ``time_scale``, as ``copies`` tenants ``copy_shift_s`` apart in all
    (see :func:`trace_workload`)."""

    limit: int | None = None
    time_scale: float = 1.0
    copies: int = 1
    copy_shift_s: float = 60.0

    def __post_init__(self) -> None:
        if self.copies < 1 or self.copy_shift_s < 0:
            raise ValueError("copies must be positive and copy_shift_s not negative")


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


def trace_workload(path: str | Path, config: TraceConfig | None = None) -> Workload:
    """A Mooncake-format JSONL trace: one request per line, at its timestamp (ms).

    ``copies`` > 1 scales it for a larger fleet: copy k replays the trace as tenant
    ``copy-k`` (a cache salt of its own, so no copy shares a block with another) and
    ``k * copy_shift_s / copies`` seconds later, so the copies interleave.
    """
    config = config or TraceConfig()
    limit, copies, copy_shift_s = config.limit, config.copies, config.copy_shift_s
    sessions = []
    with open(path, encoding="utf-8") as lines:
        for index, line in enumerate(lines):
            if limit is not None and index >= limit:
                break
            hash_ids, length, start_ms, output = _trace_record(path, index + 1, line)
            start = start_ms / 1000.0 * config.time_scale
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
        needs, lacks = ", ".join(TRACE_FIELDS), ", ".join(missing)
        raise ValueError(f"{where}: a Mooncake trace line needs {needs}; missing {lacks}")
    try:
        hash_ids = tuple(int(h) for h in record["hash_ids"])
        length, output = int(record["input_length"]), int(record["output_length"])
        return hash_ids, length, float(record["timestamp"]), output
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


class Trace(WorkloadKind):
    """``trace:PATH``: a recorded trace (TraceConfig), copied once per
    ``replicas_per_copy`` replicas if asked."""

    name = "trace"
    usage = "trace:PATH"
    parameters = TraceConfig

    def build(self, argument: str, overrides: Mapping[str, Any]) -> Workload:
        if not Path(argument).is_file():
            raise ValueError(f"trace file {argument!r} not found")
        return trace_workload(argument, configured(TraceConfig, overrides, self.name))

    def overrides(self, options: WorkloadOptions) -> dict[str, Any]:
        parameters: dict[str, Any] = {} if options.limit is None else {"limit": options.limit}
        if options.replicas_per_copy is not None:
            parameters["copies"] = max(1, options.replicas // options.replicas_per_copy)
            parameters["copy_shift_s"] = options.copy_shift_s
        return parameters

    def scales_with_fleet(self, options: WorkloadOptions) -> bool:
        return options.replicas_per_copy is not None
