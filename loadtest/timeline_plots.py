"""The bench's charts over time, as the live dashboard draws them while a run goes:
hit rate and TTFT per policy, and per replica its outstanding requests and its cache.

Every run starts with empty caches at second 0, so the rows' lines share one axis.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np

from loadtest.plots import save_figure
from loadtest.timeline import WINDOW_S, Timeline

#: One colour per row, in order, in every chart (the first four of matplotlib's own).
COLOURS = ("#4C72B0", "#DD8452", "#55A868", "#C44E52", "#8172B3", "#937860")


def hit_rate_over_time_chart(timelines: Mapping[str, Timeline], path: Path) -> None:
    """Per row: cached over prompt tokens of the requests sent in each window."""
    fig, ax = plt.subplots(figsize=(7, 4))
    for (label, timeline), colour in zip(timelines.items(), COLOURS, strict=False):
        times, rates = timeline.hit_rate()
        ax.plot(times, [100 * r for r in rates], marker=".", color=colour, label=label)
    ax.set_xlabel("seconds since the run started (caches empty)")
    ax.set_ylabel(f"token hit rate (%), per {WINDOW_S:.0f} s")
    ax.set_ylim(0, 100)
    ax.set_title("Prefix-cache hit rate over time")
    _finish(ax, fig, path)


def ttft_over_time_chart(timelines: Mapping[str, Timeline], path: Path) -> None:
    """Per row: TTFT median (solid) and 90th percentile (dashed) in each window."""
    fig, ax = plt.subplots(figsize=(7, 4))
    for (label, timeline), colour in zip(timelines.items(), COLOURS, strict=False):
        times, p50 = timeline.ttft(50)
        _, p90 = timeline.ttft(90)
        ax.plot(times, [1000 * v for v in p50], color=colour, label=f"{label} p50")
        ax.plot(times, [1000 * v for v in p90], color=colour, linestyle="--", label=f"{label} p90")
    ax.set_xlabel("seconds since the run started (caches empty)")
    ax.set_ylabel(f"TTFT (ms), per {WINDOW_S:.0f} s")
    ax.set_yscale("log")
    ax.set_title("Time to first token over time")
    _finish(ax, fig, path)


def replica_load_chart(timelines: Mapping[str, Timeline], path: Path) -> None:
    """One panel per row: each replica's running and waiting requests, sampled."""
    _per_replica(timelines, path, (("outstanding", "-"),), "requests at the replica")


def cache_occupancy_chart(timelines: Mapping[str, Timeline], path: Path) -> None:
    """One panel per row: each replica's blocks holding cached KV (solid) and pinned by
    running requests (dashed), as shares of its capacity."""
    series = (("cached", "-"), ("in_use", "--"))
    ylabel = "% of KV blocks (solid: cached, dashed: in use)"
    _per_replica(timelines, path, series, ylabel, scale=100, ylim=(0, 105))


def _per_replica(
    timelines: Mapping[str, Timeline],
    path: Path,
    series: Sequence[tuple[str, str]],
    ylabel: str,
    scale: float = 1.0,
    ylim: tuple[float, float] | None = None,
) -> None:
    """Per row a panel; in it, per replica one colour, one line style per series (the
    first series carries the legend)."""
    fig, axes = _panels(len(timelines))
    for ax, (label, timeline) in zip(axes, timelines.items(), strict=True):
        seconds = timeline.seconds()
        for number, (key, style) in enumerate(series):
            values = np.asarray(getattr(timeline, key))
            for index in range(values.shape[1] if values.ndim == 2 else 0):
                ax.plot(
                    seconds,
                    scale * values[:, index],
                    color=COLOURS[index % len(COLOURS)],
                    linestyle=style,
                    linewidth=1.2 if number == 0 else 0.8,
                    label=f"replica {index}" if number == 0 else None,
                )
        _panel(ax, label, ylabel if ax is axes[0] else "", ylim)
    save_figure(fig, path)


def _panels(count: int) -> tuple[plt.Figure, list[plt.Axes]]:
    """Side by side, one per row, sharing the axes so the runs compare at a glance."""
    fig, axes = plt.subplots(
        1, max(count, 1), figsize=(3.6 * max(count, 1) + 1, 3.6), sharey=True, squeeze=False
    )
    return fig, list(axes[0])


def _panel(ax: plt.Axes, label: str, ylabel: str, ylim: tuple[float, float] | None = None) -> None:
    ax.set_title(label, fontsize=10)
    ax.set_xlabel("seconds", fontsize=8)
    ax.set_ylabel(ylabel, fontsize=8)  # the first panel's only: the axis is shared
    if ylim:
        ax.set_ylim(*ylim)
    ax.grid(True, alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7)


def _finish(ax: plt.Axes, fig: plt.Figure, path: Path) -> None:
    ax.grid(True, alpha=0.3)
    if ax.get_legend_handles_labels()[0]:  # no runs, no legend (and no warning)
        ax.legend(fontsize=7, ncol=2)
    save_figure(fig, path)
