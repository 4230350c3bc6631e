"""The replica's Prometheus figures, under vLLM's metric names.

Counters and gauges are read from the engine at scrape time, so serving a request
costs nothing here but one histogram observation (time to first token).
"""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from replica.engine import Engine

TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0)


class EngineCollector:
    """Reads the engine's figures at scrape time, under vLLM's metric names."""

    def __init__(self, engine: Engine, model: str) -> None:
        self.engine, self.model = engine, model

    def collect(self) -> Iterable[Metric]:
        engine, stats = self.engine, self.engine.cache_stats
        counters = (
            (
                "vllm:prefix_cache_queries",
                "Prompt tokens looked up in the cache.",
                stats.query_tokens,
            ),
            (
                "vllm:prefix_cache_hits",
                "Prompt tokens found in the prefix cache.",
                stats.hit_tokens,
            ),
            ("vllm:prompt_tokens", "Prompt tokens processed.", stats.query_tokens),
            ("prefix_router:evictions", "Blocks evicted from the cache.", stats.evictions),
            ("prefix_router:preemptions", "Requests preempted.", engine.scheduler.num_preemptions),
            (
                "prefix_router:host_cache_hits",
                "Prompt tokens loaded from the host tier (counted in the prefix cache hits).",
                stats.host_hit_tokens,
            ),
            (
                "prefix_router:kv_bytes_to_host",
                "KV bytes demoted to the host.",
                engine.bytes_to_host,
            ),
            (
                "prefix_router:kv_bytes_to_gpu",
                "KV bytes loaded from the host.",
                engine.bytes_to_gpu,
            ),
        )
        gauges = (
            ("vllm:kv_cache_usage_perc", "Fraction of KV blocks pinned.", engine.cache.usage),
            ("vllm:num_requests_running", "Requests in the running batch.", engine.num_running),
            ("vllm:num_requests_waiting", "Requests waiting to be scheduled.", engine.num_waiting),
            (
                "prefix_router:host_cache_usage_perc",
                "Fraction of the host tier's blocks holding KV.",
                len(engine.host) / engine.host.num_blocks if engine.host is not None else 0.0,
            ),
        )
        for name, doc, value in counters:
            counter = CounterMetricFamily(name, doc, labels=["model_name"])
            counter.add_metric([self.model], value)
            yield counter
        for name, doc, number in gauges:
            gauge = GaugeMetricFamily(name, doc, labels=["model_name"])
            gauge.add_metric([self.model], number)
            yield gauge


class ReplicaMetrics:
    """The registry ``GET /metrics`` renders: the engine's figures and the TTFT histogram."""

    def __init__(self, engine: Engine, model: str) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(EngineCollector(engine, model))
        self.ttft = Histogram(
            "vllm:time_to_first_token_seconds",
            "Time to first token.",
            ["model_name"],
            buckets=TTFT_BUCKETS,
            registry=self.registry,
        ).labels(model)

    def render(self) -> bytes:
        return generate_latest(self.registry)
