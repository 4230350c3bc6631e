"""PNG charts of a comparison: hit rate per policy, TTFT distribution, load per replica."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only: no display on servers and in CI

import matplotlib.pyplot as plt
import numpy as np

from loadtest.report import Row


def hit_rate_chart(rows: Sequence[Row], path: Path) -> None:
    """Token hit rate per row, bounds drawn as dashed lines across the bars."""
    measured = [r for r in rows if r.get("policy")]
    bounds = [r for r in rows if not r.get("policy") and r.get("token_hit_rate") is not None]
    fig, ax = plt.subplots(figsize=(max(5.0, 1.1 * len(measured) + 2), 4))
    labels = [r["label"] for r in measured]
    rates = [100 * (r["token_hit_rate"] or 0) for r in measured]
    bars = ax.bar(labels, rates, color="#4C72B0")
    ax.bar_label(bars, fmt="%.1f%%", fontsize=8)
    for bound, style in zip(bounds, ("--", ":", "-."), strict=False):
        ax.axhline(
            100 * bound["token_hit_rate"], color="#C44E52", linestyle=style, label=bound["label"]
        )
    if bounds:
        ax.legend(fontsize=8, loc="lower right")
    ax.set_ylabel("token hit rate (%)")
    ax.set_ylim(0, 100)
    ax.set_title("Prefix-cache hit rate per policy")
    ax.tick_params(axis="x", labelrotation=20, labelsize=8)
    _save(fig, path)


def ttft_chart(ttfts: Mapping[str, Sequence[float]], path: Path) -> None:
    """Empirical CDF of time to first token per policy, log scale."""
    fig, ax = plt.subplots(figsize=(6, 4))
    for label, values in ttfts.items():
        if len(values):
            ordered = np.sort(np.asarray(values) * 1000)
            ax.plot(ordered, np.arange(1, len(ordered) + 1) / len(ordered), label=label)
    ax.set_xscale("log")
    ax.set_xlabel("time to first token (ms, log scale)")
    ax.set_ylabel("fraction of requests")
    ax.set_title("TTFT distribution")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    _save(fig, path)


def load_chart(rows: Sequence[Row], path: Path) -> None:
    """Requests sent to each replica, grouped by policy."""
    measured = [r for r in rows if r.get("policy") and r.get("requests_per_replica")]
    replicas = max((len(r["requests_per_replica"]) for r in measured), default=0)
    fig, ax = plt.subplots(figsize=(max(5.0, 1.2 * len(measured) + 2), 4))
    width = 0.8 / max(replicas, 1)
    for index in range(replicas):
        counts = [
            r["requests_per_replica"][index] if index < len(r["requests_per_replica"]) else 0
            for r in measured
        ]
        ax.bar(np.arange(len(measured)) + index * width, counts, width, label=f"replica {index}")
    ax.set_xticks(
        np.arange(len(measured)) + 0.4 - width / 2,
        [r["label"] for r in measured],
        fontsize=8,
        rotation=20,
    )
    ax.set_ylabel("requests")
    ax.set_title("Requests per replica")
    if replicas <= 8:
        ax.legend(fontsize=7, ncol=2)
    _save(fig, path)


def sweep_chart(rows: Sequence[Row], key: str, path: Path) -> None:
    """Token hit rate against the swept parameter, one line per policy."""
    fig, ax = plt.subplots(figsize=(6, 4))
    for policy in dict.fromkeys(r["policy"] for r in rows if r.get("policy")):
        points = sorted((r[key], r["token_hit_rate"]) for r in rows if r.get("policy") == policy)
        ax.plot(
            [p[0] for p in points], [100 * (p[1] or 0) for p in points], marker="o", label=policy
        )
    ax.set_xscale("log", base=2)
    ax.set_xlabel(key.replace("_", " "))
    ax.set_ylabel("token hit rate (%)")
    ax.set_title(f"Hit rate as {key.replace('_', ' ')} grows")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    _save(fig, path)


def _save(fig: plt.Figure, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
