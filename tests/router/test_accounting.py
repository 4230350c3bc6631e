"""The gateway's counters: one owner, read by /stats and /metrics alike."""

import numpy as np

from replica.api import stats as codec
from router.config import GatewayConfig
from router.core import ReplicaState, RoutingRequest
from router.fair.admission import AdmissionQueue
from router.fleet.backends import Backend
from router.http.metrics import GatewayMetrics
from router.path.accounting import Accounting
from router.policies import PolicyConfig, make_policy
from router.stats import GatewayStats, PolicyCounts
from tests.shared import FakeClock


class FakePool:
    """What the accounting and the metrics read of the backend pool."""

    def __init__(self, *names: str) -> None:
        self.backends = [
            Backend(f"http://127.0.0.1:{8001 + i}", ReplicaState(name, 64))
            for i, name in enumerate(names)
        ]


def policy(name: str):
    return make_policy(name, FakeClock(), np.random.default_rng(0), PolicyConfig())


def test_counters_per_policy_backend_and_tenant_build_stats_and_metrics():
    pool, accounting = FakePool("a", "b"), Accounting(tolerance_tokens=64)
    admission = AdmissionQueue(max_queued=4, timeout_s=1.0)
    a, b = (backend.state for backend in pool.backends)
    ours, baseline = policy("cache_aware"), policy("round_robin")
    close = RoutingRequest("1", 1000, [1], predicted_cached_tokens=512, tenant="acme")
    far = RoutingRequest("2", 1000, [2], predicted_cached_tokens=0, tenant="acme")
    exact = RoutingRequest("4", 1000, [4], predicted_cached_tokens=256)
    over = RoutingRequest("5", 1000, [5], predicted_cached_tokens=512)
    failed = RoutingRequest("3", 400, [3], tenant="globex")
    routed = (
        (close, a, ours),
        (far, a, ours),
        (exact, a, ours),
        (over, a, ours),
        (failed, b, baseline),
    )
    for request, replica, pol in routed:
        accounting.dispatched(request, replica, pol)
    accounting.first_token(close, a, ours)
    accounting.first_token(close, a, ours)  # once only
    accounting.ended(close, a, ours, cached=528, failed=False)  # under by less than a block
    accounting.ended(far, a, ours, cached=768, failed=False)  # under by 768
    accounting.ended(exact, a, ours, cached=256, failed=False)
    accounting.ended(over, a, ours, cached=128, failed=False)  # over by 384
    accounting.ended(failed, b, baseline, cached=None, failed=True)

    stats = accounting.stats("cache_aware", GatewayConfig(), pool, admission)
    assert codec.decode(GatewayStats, codec.encode(stats)) == stats
    first, second = stats.backends
    assert first.by_policy == {
        "cache_aware": PolicyCounts(
            requests=4,
            predictions=4,
            close_predictions=2,
            predicted_cached_tokens=1280,
            actual_cached_tokens=1680,
            exact_predictions=1,
            block_predictions=2,
            over_predictions=1,
            under_predictions=2,
            over_predicted_tokens=384,
            under_predicted_tokens=784,
            # a replica known by no events: the prediction was the router's decisions
            over_pending=1,
        )
    }
    assert second.by_policy == {"round_robin": PolicyCounts(1, 0, 0, 0, 0)}
    assert (first.upstream_errors, second.upstream_errors) == (0, 1)
    assert all(b.outstanding_requests == b.outstanding_prefill_tokens == 0 for b in stats.backends)
    assert stats.tenants["acme"].token_hit_rate == (528 + 768) / 2000
    assert stats.tenants["globex"].errors == 1 and stats.tenants["globex"].token_hit_rate is None

    text = GatewayMetrics(accounting, pool, admission).render().decode()
    assert 'prefix_router_routing_decisions_total{policy="cache_aware",replica="a"} 4.0' in text
    assert (
        'prefix_router_actual_cached_tokens_total{policy="cache_aware",replica="a"} 1680.0' in text
    )
    for outcome, count in (("exact", 1), ("over", 1), ("under", 2)):
        labels = f'outcome="{outcome}",policy="cache_aware",replica="a"'
        assert f"prefix_router_predictions_total{{{labels}}} {count}.0" in text
    assert (
        'prefix_router_over_predicted_tokens_total{policy="cache_aware",replica="a"} 384.0' in text
    )
    for cause, count in (("pending", 1), ("evicted", 0), ("unexplained", 0)):
        labels = f'cause="{cause}",policy="cache_aware",replica="a"'
        assert f"prefix_router_over_predictions_total{{{labels}}} {count}.0" in text
    assert 'prefix_router_unkeyed_event_blocks_total{replica="a"} 0.0' in text
    assert 'prefix_router_upstream_errors_total{replica="b"} 1.0' in text
    assert 'prefix_router_tenant_cached_tokens_total{tenant="acme"} 1296.0' in text
    assert stats.policies["cache_aware"].token_hit_rate == 1680 / 4000
    assert stats.policies["cache_aware"].ttft_count == 1
    assert stats.policies["round_robin"].errors == 1
    assert stats.policies["round_robin"].ttft_p50_s is None
    assert 'prefix_router_policy_cached_tokens_total{policy="cache_aware"} 1680.0' in text
    assert 'prefix_router_time_to_first_token_seconds_count{policy="cache_aware"} 1.0' in text
