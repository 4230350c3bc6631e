"""The engine kinds a replica can run, by name: how each says what it is and what it
counted, read from its HTTP endpoints.

A gateway meets a server by its URL alone and asks each kind in turn (ours first:
it answers ``/stats``); the bench and ``prefix-router status`` read the figures the
same way. A new engine kind is its server, its card (``replica/api/card.py``), its
line here, and the actor that hosts it (``deploy/replicas.py``).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import httpx

from replica.api import stats as stats_codec
from replica.api.card import EngineCard, sim_card, vllm_card
from replica.api.figures import EngineFigures, from_stats, from_vllm_metrics
from replica.api.stats import ReplicaStats

#: What a server answered on each path asked (absent: no 200 answer).
Answers = Mapping[str, bytes]


@dataclass(frozen=True)
class EngineKind:
    """One kind of engine: its name (``--engine``), what it is, and how to read it."""

    name: str
    #: For ``--engine``'s help.
    summary: str
    #: Whether its model is a folder it loads (``--model PATH``), not just a name.
    loads_model: bool
    #: The paths that say what it is, and its card from their answers (``None``: not
    #: this kind).
    card_paths: tuple[str, ...]
    card: Callable[[str, Answers], EngineCard | None]
    #: The paths that say what it counted, and its figures from their answers.
    figures_paths: tuple[str, ...]
    figures: Callable[[Answers], EngineFigures | None]


def _our_stats(answers: Answers) -> ReplicaStats | None:
    try:
        return stats_codec.decode(ReplicaStats, answers["/stats"])
    except (KeyError, ValueError):
        return None  # no /stats, or one of another kind


def _sim_card(url: str, answers: Answers) -> EngineCard | None:
    stats = _our_stats(answers)
    return sim_card(url, stats) if stats is not None else None


def _sim_figures(answers: Answers) -> EngineFigures | None:
    stats = _our_stats(answers)
    return from_stats(stats) if stats is not None else None


def _vllm_card(url: str, answers: Answers) -> EngineCard | None:
    metrics = answers.get("/metrics", b"").decode()
    try:
        models: Iterable[dict[str, Any]] = json.loads(answers.get("/v1/models", b"{}"))["data"]
    except (ValueError, KeyError, TypeError):
        models = []
    return vllm_card(url, metrics, models)


def _vllm_figures(answers: Answers) -> EngineFigures | None:
    return from_vllm_metrics(answers.get("/metrics", b"").decode())


SIM = EngineKind(
    name="sim",
    summary="the simulated engine (default)",
    loads_model=False,
    card_paths=("/stats",),
    card=_sim_card,
    figures_paths=("/stats",),
    figures=_sim_figures,
)
VLLM = EngineKind(
    name="vllm",
    summary="a vLLM server per replica, serving --model PATH (a Hugging Face model folder)",
    loads_model=True,
    card_paths=("/metrics", "/v1/models"),
    card=_vllm_card,
    figures_paths=("/metrics",),
    figures=_vllm_figures,
)
#: Every kind, the default first.
ENGINES: dict[str, EngineKind] = {kind.name: kind for kind in (SIM, VLLM)}


def engine(name: str) -> EngineKind:
    """The kind named ``name``; :class:`ValueError` naming the known ones if none is."""
    try:
        return ENGINES[name]
    except KeyError:
        raise ValueError(f"unknown engine {name!r}; known: {', '.join(ENGINES)}") from None


def read_figures(client: httpx.Client, url: str) -> EngineFigures:
    """The figures of the replica at ``url``, of whichever kind it is; raises
    ``ValueError`` if no kind reads them, ``httpx.HTTPError`` if it does not answer."""
    answered: dict[str, bytes | None] = {}  # each path asked once
    for kind in ENGINES.values():
        for path in kind.figures_paths:
            if path not in answered:
                answer = client.get(f"{url}{path}")
                answered[path] = answer.content if answer.status_code == 200 else None
        answers = {p: a for p in kind.figures_paths if (a := answered[p]) is not None}
        figures = kind.figures(answers)
        if figures is not None:
            return figures
    raise ValueError(f"{url} is none of the engines known ({', '.join(ENGINES)})")
