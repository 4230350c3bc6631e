"""Seeded request generators shared by the offline replayer and the Locust users.

Workloads are chosen by a spec, ``NAME`` or ``NAME:ARGUMENT``, from a registry of
kinds; one module per kind:

- ``base``: turns, sessions and workloads, and what every kind answers (``WorkloadKind``);
- ``chat``: seeded sessions of a chat service (``chat``);
- ``shared_prefix``: many groups sharing long prompts, short questions, long answers;
- ``trace``: a recorded trace in Mooncake's format (``trace:PATH``).

A new kind is its module (a ``WorkloadKind``) and one line in :data:`WORKLOADS`. The
same spec, parameters and seed always give the same requests.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from loadtest.workloads.base import (
    ARRIVAL_MODES,
    ArrivalMode,
    Session,
    Turn,
    Workload,
    WorkloadKind,
    WorkloadOptions,
)
from loadtest.workloads.chat import (
    RATE_SHAPES,
    Chat,
    ChatConfig,
    chat_workload,
    day_shaped,
    ramp_shaped,
    retokenized,
)
from loadtest.workloads.shared_prefix import SHARED_PREFIX, SharedPrefix
from loadtest.workloads.trace import (
    TRACE_BLOCK_TOKENS,
    TRACE_FIELDS,
    Trace,
    TraceConfig,
    trace_block_tokens,
    trace_prompt,
    trace_workload,
)

__all__ = [
    "ARRIVAL_MODES",
    "RATE_SHAPES",
    "SHARED_PREFIX",
    "TRACE_BLOCK_TOKENS",
    "TRACE_FIELDS",
    "WORKLOADS",
    "ArrivalMode",
    "ChatConfig",
    "Session",
    "TraceConfig",
    "Turn",
    "Workload",
    "WorkloadKind",
    "WorkloadOptions",
    "chat_workload",
    "day_shaped",
    "load_workload",
    "ramp_shaped",
    "retokenized",
    "trace_block_tokens",
    "trace_prompt",
    "trace_workload",
    "workload_for",
    "workload_kind",
    "workload_usage",
]

WORKLOADS: dict[str, WorkloadKind] = {kind.name: kind for kind in (Chat(), SharedPrefix(), Trace())}


def workload_usage() -> str:
    """The specs the registry knows, as help texts show them: ``chat or trace:PATH``."""
    return " or ".join(kind.usage for kind in WORKLOADS.values())


def workload_kind(spec: str) -> WorkloadKind:
    """The kind of workload ``spec`` names; ``ValueError`` if none."""
    return _parsed(spec)[0]


def load_workload(spec: str, overrides: Mapping[str, Any] | None = None) -> Workload:
    """The workload ``spec`` names (``chat``, ``trace:PATH``), with ``overrides`` of its
    kind's parameters (ChatConfig's fields; a trace's ``limit``, ``copies``, ...)."""
    kind, argument = _parsed(spec)
    return kind.build(argument, dict(overrides or {}))


def workload_for(spec: str, options: WorkloadOptions) -> Workload:
    """The workload ``spec`` names, with the parameters its kind takes from ``options``."""
    kind, argument = _parsed(spec)
    return kind.build(argument, kind.overrides(options))


def _parsed(spec: str) -> tuple[WorkloadKind, str]:
    name, colon, argument = spec.partition(":")
    kind = WORKLOADS.get(name)
    if kind is None or bool(colon) != kind.takes_argument:
        expected = " or ".join(repr(kind.usage) for kind in WORKLOADS.values())
        raise ValueError(f"unknown workload {spec!r}; expected {expected}")
    return kind, argument
