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
    save_figure(fig, path)


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
    save_figure(fig, path)


def load_chart(rows: Sequence[Row], path: Path) -> None:
    """Requests sent to each replica, grouped by row (pass the measured rows); a row
    without per-replica counts (a server or router that is not ours) is named, not drawn."""
    measured = [r for r in rows if r.get("requests_per_replica")]
    unknown = [r["label"] for r in rows if not r.get("requests_per_replica")]
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
    if unknown:
        note = f"no per-replica counts: {', '.join(unknown)}"
        ax.text(0.5, 0.5, note, transform=ax.transAxes, ha="center", fontsize=8, color="#777777")
    if 0 < replicas <= 8:  # no bars, no legend (matplotlib warns of an empty one)
        ax.legend(fontsize=7, ncol=2)
    save_figure(fig, path)


def fleet_size_chart(rows: Sequence[Row], path: Path) -> None:
    """Replicas held over the run, a step line per row that scaled (and per pool of a
    disaggregated fleet)."""
    fig, ax = plt.subplots(figsize=(7, 3.5))
    for row in rows:
        if row.get("fleet_sizes"):
            _steps(ax, row["fleet_sizes"], row["duration_s"], row["label"])
        for role, sizes in (row.get("pool_sizes") or {}).items():
            _steps(ax, sizes, row["duration_s"], f"{row['label']}: {role}")
    ax.set_xlabel("seconds")
    ax.set_ylabel("replicas")
    ax.set_title("The fleet's size")
    ax.legend(fontsize=8)
    save_figure(fig, path)


def hot_sets_chart(rows: Sequence[Row], path: Path, shown: int = 3) -> None:
    """Each row's largest hot prefixes' replication sets over the run."""
    fig, ax = plt.subplots(figsize=(7, 3.5))
    for row in rows:
        sets = row.get("hot_sets") or {}
        for prefix, figures in sorted(sets.items(), key=lambda i: -i[1]["largest"])[:shown]:
            _steps(ax, figures["sizes"], row["duration_s"], f"{row['label']}: {prefix[:8]}")
    ax.set_xlabel("seconds")
    ax.set_ylabel("replicas holding it on purpose")
    ax.set_title("Hot prefixes' replication sets")
    ax.legend(fontsize=8)
    save_figure(fig, path)


def _steps(ax: plt.Axes, sizes: Sequence[Sequence[float]], end: float, label: str) -> None:
    """A size that holds from each (time, size) on, drawn to ``end``."""
    times = [t for t, _ in sizes] + [end]
    ax.step(times, [n for _, n in sizes] + [sizes[-1][1]], where="post", label=label)


def live_hit_rate_chart(rows: Sequence[Row], path: Path) -> None:
    """Per policy: the engines' token hit rate, the clients' and the replay's prediction."""
    series = (
        ("token_hit_rate", "engines", "#4C72B0"),
        ("client_token_hit_rate", "clients (usage)", "#55A868"),
        ("replay_token_hit_rate", "replay prediction", "#BBBBBB"),
    )
    _grouped_bars(rows, series, path, "token hit rate (%)", "Prefix-cache hit rate", 100, "%.1f")


def ttft_percentiles_chart(rows: Sequence[Row], path: Path) -> None:
    """Per policy: time to first token at the median and the 99th percentile."""
    series = (
        ("ttft_p50_s", "TTFT p50", "#4C72B0"),
        ("ttft_p99_s", "TTFT p99", "#C44E52"),
        ("replay_ttft_p99_s", "replay p99", "#BBBBBB"),
    )
    _grouped_bars(rows, series, path, "milliseconds", "Time to first token", 1000, "%.0f")


TENANT_COLORS = ("#4C72B0", "#55A868", "#8172B2", "#C44E52", "#CCB974", "#64B5CD")


def tenant_ttft_chart(rows: Sequence[Row], path: Path) -> None:
    """Per run: each tenant's TTFT p99, one bar per tenant."""
    runs = [r for r in rows if r.get("tenants")]
    tenants = sorted({name for r in runs for name in r["tenants"]})
    flat = [
        {"label": r["label"], **{t: r["tenants"].get(t, {}).get("ttft_p99_s") for t in tenants}}
        for r in runs
    ]
    series = [(t, t, TENANT_COLORS[i % len(TENANT_COLORS)]) for i, t in enumerate(tenants)]
    _grouped_bars(flat, series, path, "milliseconds", "TTFT p99 per tenant", 1000, "%.0f")


def _grouped_bars(
    rows: Sequence[Row],
    series: Sequence[tuple[str, str, str]],
    path: Path,
    ylabel: str,
    title: str,
    scale: float,
    fmt: str,
) -> None:
    present = [s for s in series if any(r.get(s[0]) is not None for r in rows)]
    fig, ax = plt.subplots(figsize=(max(5.0, 1.6 * len(rows) + 2), 4))
    width = 0.8 / max(len(present), 1)
    for index, (key, name, color) in enumerate(present):
        values = [scale * (r.get(key) or 0) for r in rows]
        bars = ax.bar(np.arange(len(rows)) + index * width, values, width, label=name, color=color)
        ax.bar_label(bars, fmt=fmt, fontsize=7)
    ax.set_xticks(np.arange(len(rows)) + 0.4 - width / 2, [r["label"] for r in rows], fontsize=8)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.margins(y=0.12)  # room for the bar labels
    if present:
        ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.1), ncol=len(present))
    save_figure(fig, path)


def sweep_chart(rows: Sequence[Row], key: str, path: Path) -> None:
    """Hit rate, TTFT and imbalance against the swept parameter, one line per policy;
    the single pooled engine of the same size drawn dashed on the hit rate, as the
    target (its TTFT and spread, one engine N times as fast, compare with nothing)."""
    panels = (
        ("token_hit_rate", "token hit rate (%)", 100.0),
        ("ttft_p99_s", "TTFT p99 (ms)", 1000.0),
        ("imbalance", "imbalance (max / mean requests)", 1.0),
    )
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    lines = _sweep_lines(rows, key)
    swept = sorted({x for points in lines.values() for x, _ in points})
    for ax, (figure, ylabel, scale) in zip(axes, panels, strict=True):
        for name, points in lines.items():
            if name == POOLED and figure != "token_hit_rate":
                continue
            xs = [x for x, row in points if row.get(figure) is not None]
            ys = [scale * row[figure] for _, row in points if row.get(figure) is not None]
            if xs:
                style = "--" if name == POOLED else "-"
                ax.plot(xs, ys, marker="o", linestyle=style, label=name)
        ax.set_xscale("log", base=2)
        ax.set_xticks(swept, [str(x) for x in swept])
        ax.set_xlabel(key.replace("_", " "))
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
    axes[0].set_title(f"Hit rate as {key.replace('_', ' ')} grows")
    axes[1].set_ylim(bottom=0)
    axes[1].set_title("Time to first token")
    axes[2].set_title("Load spread")
    axes[0].legend(fontsize=8)
    save_figure(fig, path)


#: The legend's name for the ``single_engine_Nx`` rows: one pooled engine per size.
POOLED = "single engine (pooled)"


def saturation_chart(rows: Sequence[Row], path: Path) -> None:
    """Hit rate and TTFT p90 against the offered load (a multiple of the fleet's
    capacity), a line per policy; capacity marked."""
    panels = (("token_hit_rate", "token hit rate (%)", 100.0), ("ttft_p90_s", "TTFT p90 (s)", 1.0))
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    policies = list(dict.fromkeys(row["policy"] for row in rows))
    for ax, (figure, ylabel, scale) in zip(axes, panels, strict=True):
        for policy in policies:
            points = sorted(
                (row["load"], scale * row[figure]) for row in rows if row["policy"] == policy
            )
            ax.plot(*zip(*points, strict=True), marker="o", label=policy)
        ax.axvline(1.0, color="#999999", linestyle=":", linewidth=1)
        ax.set_xlabel("offered load (x the fleet's capacity)")
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
    axes[0].set_title("Hit rate as the fleet saturates")
    axes[1].set_yscale("log")
    axes[1].set_title("Time to first token, p90")
    axes[0].legend(fontsize=8)
    save_figure(fig, path)


def _sweep_lines(rows: Sequence[Row], key: str) -> dict[str, list[tuple[float, Row]]]:
    """Rows grouped into lines: one per policy, one for the pooled engines."""
    lines: dict[str, list[tuple[float, Row]]] = {}
    for row in rows:
        if row.get("policy"):
            name = row["policy"]
        elif str(row["label"]).startswith("single_engine"):
            name = POOLED
        else:
            continue
        lines.setdefault(name, []).append((row[key], row))
    return {name: sorted(points, key=lambda p: p[0]) for name, points in lines.items()}


def save_figure(fig: plt.Figure, path: Path) -> None:
    """Write ``fig`` as a PNG and free it (pyplot keeps every open figure)."""
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
