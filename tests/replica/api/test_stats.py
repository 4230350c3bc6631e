"""Typed statistics: a replica's and a gateway's ``/stats`` encode and decode to equal values."""

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from replica.api import stats as codec
from replica.api.config import ReplicaConfig
from replica.api.stats import CacheFigures, ReplicaStats
from router.config import GatewayConfig
from router.index.prefix_index import IndexConfig
from router.policies import PolicyConfig
from router.policies.cache_aware import CacheAwareConfig
from router.stats import BackendStats, GatewayStats, PolicyCounts, TenantStats

counts = st.integers(0, 2**40)
rates = st.none() | st.floats(0, 1)
cache_figures = st.builds(
    CacheFigures,
    *([counts] * 8),
    usage=st.floats(0, 1),
    token_hit_rate=rates,
    block_hit_rate=rates,
)
replica_stats = st.builds(
    ReplicaStats,
    model=st.text(max_size=20),
    pid=counts,
    config=st.builds(ReplicaConfig, num_blocks=st.integers(1, 10**6), speedup=st.floats(0.1, 100)),
    requests=counts,
    errors=counts,
    running=counts,
    waiting=counts,
    cache=cache_figures,
    preemptions=counts,
    steps=counts,
    busy_s=st.floats(0, 1e6),
)
policy_counts = st.builds(PolicyCounts, counts, counts, counts, counts, counts)
gateway_stats = st.builds(
    GatewayStats,
    policy=st.sampled_from(["round_robin", "cache_aware"]),
    retries=counts,
    refused=counts,
    queued=counts,
    config=st.builds(
        GatewayConfig,
        routing=st.builds(
            PolicyConfig,
            block_size=st.integers(1, 64),
            index=st.builds(IndexConfig, stride=st.integers(1, 16)),
            cache_aware=st.builds(CacheAwareConfig, recompute_weight=st.floats(0.5, 64)),
        ),
    ),
    backends=st.lists(
        st.builds(
            BackendStats,
            url=st.just("http://127.0.0.1:8001"),
            replica_id=st.text(min_size=1, max_size=12),
            dispatched=counts,
            outstanding_requests=counts,
            outstanding_prefill_tokens=counts,
            by_policy=st.dictionaries(
                st.sampled_from(["round_robin", "cache_aware"]), policy_counts
            ),
            upstream_errors=counts,
            kv_events=st.booleans(),
            healthy=st.booleans(),
        ),
        max_size=3,
    ),
    tenants=st.dictionaries(
        st.text(min_size=1, max_size=8),
        st.builds(TenantStats, counts, counts, counts, counts, rates),
        max_size=3,
    ),
)


@given(replica_stats)
def test_replica_stats_survive_json(stats):
    text = json.dumps(codec.encode(stats))
    assert codec.decode(ReplicaStats, text) == stats
    assert codec.decode(ReplicaStats, json.loads(text)) == stats


@given(gateway_stats)
def test_gateway_stats_survive_json_routing_knobs_and_all(stats):
    decoded = codec.decode(GatewayStats, json.dumps(codec.encode(stats)))
    assert decoded == stats
    assert decoded.config.routing.stride_tokens == stats.config.routing.stride_tokens


def test_a_renamed_or_missing_field_fails_at_once_naming_it():
    cache = CacheFigures(10, 5, 1, 0, 1, 0, 64, 1, 0.0, 0.5, 0.0)
    stats = ReplicaStats("m", 1, ReplicaConfig(), 1, 0, 0, 0, cache, 0, 3, 0.1)
    data = codec.encode(stats)
    data["cache"]["hits"] = data["cache"].pop("hit_tokens")
    with pytest.raises(ValueError, match="hit_tokens"):
        codec.decode(ReplicaStats, data)
