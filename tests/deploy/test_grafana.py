"""The Grafana dashboard in deploy/grafana names only metrics the project exports.

Every query's metric names are checked against what a real gateway and a real
replica serve at ``/metrics`` after a few requests, so renaming a metric without
the dashboard (or the other way round) fails here.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from deploy.processes import running

pytestmark = pytest.mark.slow

BOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "prefix-router.json"
MODIFIERS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "offset"}
#: PromQL's words that are not metric names (aggregations and functions are followed by "(").
KEYWORDS = MODIFIERS | {"and", "or", "unless"}


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL query reads: its identifiers once label matchers,
    ranges, grouping clauses, strings and function calls are taken out."""
    expr = re.sub(r'"[^"]*"', "", expr)
    expr = re.sub(r"\{[^}]*\}|\[[^\]]*\]", "", expr)
    expr = re.sub(r"\b(by|without|on|ignoring)\s*\([^)]*\)", "", expr)
    expr = re.sub(r"\b\d[\d.]*(e[-+]?\d+)?[smhdwy]*\b", "", expr)  # numbers, durations
    names = re.findall(r"([a-zA-Z_:][a-zA-Z0-9_:]*)\s*(\(?)", expr)
    return {name for name, call in names if not call and name not in KEYWORDS}


def label_names(expr: str) -> set[str]:
    """The labels a query groups, joins or filters by (``le``, a histogram's, aside)."""
    grouped = re.findall(r"\b(?:by|without|on|ignoring)\s*\(([^)]*)\)", expr)
    matched = re.findall(r"([a-zA-Z_][a-zA-Z0-9_]*)\s*(?:=~|!~|!=|=)\s*\"", expr)
    names = {n.strip() for group in grouped for n in group.split(",") if n.strip()}
    return (names | set(matched)) - {"le", "job", "instance"}  # Prometheus adds the last two


def exported(url: str, headers: dict[str, str] | None = None) -> dict[str, set[str]]:
    """Every sample's name, with the labels it carries."""
    text = httpx.get(f"{url}/metrics", headers=headers).text
    labels: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels.setdefault(sample.name, set()).update(sample.labels)
    return labels


def test_label_names_are_read_from_queries():
    expr = 'sum by (le, policy) (rate(a_bucket{job="x", replica=~"r.*"}[5m])) / on (tenant) b'
    assert label_names(expr) == {"policy", "replica", "tenant"}


def test_metric_names_are_read_from_queries():
    expr = (
        'histogram_quantile(0.9, sum by (le, policy) (rate(a_bucket{job="x"}[$__rate_interval])))'
        " / on (policy) b:c_total offset 5m * 1e-3"
    )
    assert metric_names(expr) == {"a_bucket", "b:c_total"}


def test_every_query_names_a_metric_that_a_gateway_or_a_replica_exports(monkeypatch):
    # Tenant figures too: Prometheus scrapes with an administrator's key to see them.
    monkeypatch.setenv("PREFIX_ROUTER_API_KEYS", "grafana-test-key=ops:admin")
    replica = ["replica", "--speedup", "50", "--num-blocks", "256", "--host-blocks", "512"]
    gateway = ["gateway", "--backend"]
    with running(replica) as (replica_url,), running([*gateway, replica_url]) as (url,):
        headers = {"authorization": "Bearer grafana-test-key"}
        for i in range(4):
            body = {"prompt": "A shared system prompt. " * 20 + f"{i}", "max_tokens": 2}
            httpx.post(f"{url}/v1/completions", json=body, headers=headers).raise_for_status()
        known = {**exported(url, headers), **exported(replica_url)}

    board = json.loads(BOARD.read_text())
    panels = [p for p in board["panels"] if p["type"] != "row"]
    assert len({p["id"] for p in board["panels"]}) == len(board["panels"])
    for panel in panels:
        names = set().union(*(metric_names(t["expr"]) for t in panel["targets"]))
        assert names, f"panel {panel['title']!r} reads no metric"
        assert names <= known.keys(), (
            f"panel {panel['title']!r}: not exported: {names - known.keys()}"
        )
        carried = set().union(*(known[name] for name in names))
        for target in panel["targets"]:
            missing = label_names(target["expr"]) - carried
            assert not missing, f"panel {panel['title']!r}: no metric of it has {missing}"
    everything = set().union(*(metric_names(t["expr"]) for p in panels for t in p["targets"]))
    assert {"vllm:prefix_cache_hits_total", "prefix_router_routing_decisions_total"} <= everything
