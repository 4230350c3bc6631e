"""The client-side token hit rate in Locust's own figures, beside TTFT and ITL.

Locust counts requests and times; a prefix cache is judged by the share of prompt
tokens it served, which the usage block of each answer carries
(``prompt_tokens_details.cached_tokens``). Through Locust's extension points:

- **request statistics**: entries of type ``HIT%`` per request name, so the figure is
  in the live table, the ``--csv`` files and the ``--html`` report. ``HIT% chat`` is
  cached over prompt tokens of every answer so far (the replicas' own figure: every
  percentile column holds it); ``HIT% chat per answer`` is each answer's own share,
  whose percentiles say how evenly the hits fall. Values are percent, in the columns
  Locust labels milliseconds (as TTFT and ITL are in their entries).
- **a web UI tab**, "Cache hits": per name the answers, prompt and cached tokens, the
  token hit rate and that of the last minute, refreshed with the statistics; the
  same as JSON at :data:`ROUTE` and as CSV at ``ROUTE + "/csv"``.
"""

from __future__ import annotations

import csv
import io
import json
import threading
import time
from collections import defaultdict, deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from flask import request
from locust.env import Environment
from locust.stats import StatsEntry, bucket_response_time

#: The request type of the hit-rate entries in Locust's statistics.
KIND = "HIT%"
#: The web UI's JSON route for the tab's figures (``/csv`` after it: the same as CSV).
ROUTE = "/prefix-router/cache-hits"
TAB = "cache-hits"
#: The "last minute" of the tab.
RECENT_S = 60.0
COLUMNS = (
    ("name", "Name"),
    ("answers", "Answers"),
    ("prompt_tokens", "Prompt tokens"),
    ("cached_tokens", "Cached tokens"),
    ("token_hit_rate", "Token hit rate"),
    ("recent_hit_rate", "Last minute"),
)


@dataclass
class HitCounts:
    answers: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0

    @property
    def rate(self) -> float | None:
        """Cached over prompt tokens; ``None`` before any prompt token."""
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else None


class CacheHits:
    """Hits per request name, since the start (or the web UI's reset) and recently.

    ``add`` also writes the figures into the environment's statistics; Locust's users
    are greenlets, and the web UI reads from another, hence the lock.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._totals: dict[str, HitCounts] = {}
        self._recent: dict[str, deque[tuple[float, int, int]]] = {}

    def add(self, environment: Environment, name: str, prompt: int, cached: int) -> None:
        with self._lock:
            total = self._totals.setdefault(name, HitCounts())
            total.answers += 1
            total.prompt_tokens += prompt
            total.cached_tokens += cached
            self._recent.setdefault(name, deque()).append((self._clock(), prompt, cached))
            if prompt:
                share = 100 * cached / prompt  # a float: Locust times are, though typed int
                _entry(environment, f"{name} per answer").log(share, cached)  # type: ignore[arg-type]
            if total.rate is not None:
                _hold(_entry(environment, name), 100 * total.rate, total)

    def reset(self) -> None:
        with self._lock:
            self._totals.clear()
            self._recent.clear()

    def table(self) -> list[dict[str, Any]]:
        """One row per name: the tab's, the JSON route's and the CSV's."""
        with self._lock:
            return [self._row(name, total) for name, total in sorted(self._totals.items())]

    def _row(self, name: str, total: HitCounts) -> dict[str, Any]:
        recent = self._recent_counts(name)
        return {
            "name": name,
            "answers": total.answers,
            "prompt_tokens": total.prompt_tokens,
            "cached_tokens": total.cached_tokens,
            "token_hit_rate": _percent(total.rate),
            "recent_hit_rate": _percent(recent.rate),
        }

    def _recent_counts(self, name: str) -> HitCounts:
        """The last :data:`RECENT_S` of answers (older ones dropped on the way)."""
        window = self._recent.get(name, deque())
        while window and window[0][0] < self._clock() - RECENT_S:
            window.popleft()
        return HitCounts(len(window), sum(p for _, p, _ in window), sum(c for _, _, c in window))


def _entry(environment: Environment, name: str) -> StatsEntry:
    # Straight into the entry, not through the request event: hit rates are not
    # requests, so Locust's "Aggregated" row of requests leaves them out.
    return environment.stats.get(name, KIND)


def _hold(entry: StatsEntry, value: float, total: HitCounts) -> None:
    """Make ``entry`` read ``value`` in every response-time column, over the answers
    so far (Locust keeps no weighted figure, so the whole-run rate is set, not logged)."""
    entry.reset()
    entry.num_requests = total.answers
    # Floats where Locust's annotations say int: its own HTTP clients log float times.
    entry.total_response_time = value * total.answers  # type: ignore[assignment]
    entry.min_response_time = entry.max_response_time = value  # type: ignore[assignment]
    entry.response_times = defaultdict(int, {bucket_response_time(value): total.answers})
    entry.total_content_length = total.cached_tokens


def _percent(rate: float | None) -> str:
    return "-" if rate is None else f"{100 * rate:.1f}%"


def as_csv(rows: list[dict[str, Any]]) -> str:
    out = io.StringIO()
    writer = csv.writer(out)
    writer.writerow([title for _, title in COLUMNS])
    writer.writerows([[row[key] for key, _ in COLUMNS] for row in rows])
    return out.getvalue()


def install_web_ui(environment: Environment, hits: CacheHits) -> None:
    """The "Cache hits" tab, its JSON and CSV routes (a no-op without a web UI)."""
    web_ui = environment.web_ui
    if web_ui is None or web_ui.app is None:
        return
    web_ui.template_args["extended_tabs"] = [{"title": "Cache hits", "key": TAB}]
    web_ui.template_args["extended_tables"] = [
        {"key": TAB, "structure": [{"key": key, "title": title} for key, title in COLUMNS]}
    ]
    web_ui.template_args["extended_csv_files"] = [
        {"href": f"{ROUTE}/csv", "title": "Download the cache hits as CSV"}
    ]
    app = web_ui.app

    @app.route(ROUTE)
    def cache_hits() -> Any:
        return app.response_class(json.dumps({"rows": hits.table()}), mimetype="application/json")

    @app.route(f"{ROUTE}/csv")
    def cache_hits_csv() -> Any:
        return app.response_class(as_csv(hits.table()), mimetype="text/csv")

    @app.after_request
    def add_to_stats(response: Any) -> Any:
        # The UI polls /stats/requests; its tabs read their rows from "extended_stats".
        if response.mimetype == "application/json" and _is_stats_request():
            figures = {
                **response.get_json(),
                "extended_stats": [{"key": TAB, "data": hits.table()}],
            }
            response.set_data(json.dumps(figures))
        return response


def _is_stats_request() -> bool:
    return request.path.endswith("/stats/requests")
