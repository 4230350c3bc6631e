"""What any engine replica counted, ours or vLLM: requests, and its prefix cache's hits.

Our replicas say it in their ``/stats`` (since their last reset); a vLLM server in its
``/metrics`` (``vllm:request_success_total``, ``vllm:prefix_cache_queries_total`` and
``vllm:prefix_cache_hits_total``, since it started: compare two readings). The bench
and ``prefix-router status`` read both the same way.
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

from replica.api.stats import ReplicaStats

#: vLLM's counters, by the name ``prometheus_client`` gives their family (no ``_total``).
VLLM_COUNTERS = {
    "vllm:request_success": "requests",
    "vllm:prefix_cache_queries": "query_tokens",
    "vllm:prefix_cache_hits": "hit_tokens",
}


@dataclass(frozen=True)
class EngineFigures:
    """Requests answered, and prompt tokens looked up in the prefix cache and found."""

    requests: int
    query_tokens: int
    hit_tokens: int

    @property
    def token_hit_rate(self) -> float | None:
        return self.hit_tokens / self.query_tokens if self.query_tokens else None

    def since(self, earlier: EngineFigures) -> EngineFigures:
        """What was counted between ``earlier`` and this reading."""
        return EngineFigures(
            self.requests - earlier.requests,
            self.query_tokens - earlier.query_tokens,
            self.hit_tokens - earlier.hit_tokens,
        )


def from_stats(stats: ReplicaStats) -> EngineFigures:
    return EngineFigures(stats.requests, stats.cache.query_tokens, stats.cache.hit_tokens)


def from_vllm_metrics(text: str) -> EngineFigures | None:
    """A vLLM server's counters (summed over their labels); ``None`` if not vLLM's."""
    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        field = VLLM_COUNTERS.get(family.name)
        if field is not None:
            samples = [s.value for s in family.samples if s.name.endswith("_total")]
            totals[field] = sum(samples)
    if len(totals) < len(VLLM_COUNTERS):
        return None
    requests, queries, hits = (int(totals[name]) for name in VLLM_COUNTERS.values())
    return EngineFigures(requests, queries, hits)


def vllm_requests_in_engine(text: str) -> int:
    """The requests a vLLM server runs or queues now, from its ``/metrics`` gauges
    (``vllm:num_requests_running`` and ``_waiting``, summed over their labels)."""
    gauges = ("vllm:num_requests_running", "vllm:num_requests_waiting")
    families = text_string_to_metric_families(text)
    return int(sum(s.value for f in families if f.name in gauges for s in f.samples))
