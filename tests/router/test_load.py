"""Load accounting, shared by the gateway and the replayer: every path returns it to zero."""

import numpy as np

from router import load
from router.policies import PolicyConfig, ReplicaState, RoutingRequest, make_policy
from tests.shared import FakeClock


def policy():
    return make_policy("cache_aware", FakeClock(), np.random.default_rng(0), PolicyConfig())


def test_prefill_loads_the_replica_until_the_first_token_requests_until_the_end():
    replica, pol = ReplicaState("r", 64), policy()
    request = RoutingRequest("a", 1000, [1, 2, 3], predicted_cached_tokens=256)
    load.dispatched(pol, request, replica)
    assert (replica.outstanding_requests, replica.outstanding_prefill_tokens) == (1, 744)
    assert replica.dispatched == 1
    load.prefilled(request, replica)
    load.prefilled(request, replica)  # idempotent: every ending path may call it
    assert (replica.outstanding_requests, replica.outstanding_prefill_tokens) == (1, 0)
    load.completed(pol, request, replica)
    assert (replica.outstanding_requests, replica.outstanding_prefill_tokens) == (0, 0)


def test_a_request_that_ends_before_its_first_token_releases_its_prefill_too():
    replica, pol = ReplicaState("r", 64), policy()
    requests = [RoutingRequest(f"r{i}", 500, [i]) for i in range(3)]
    for request in requests:
        load.dispatched(pol, request, replica)
    assert replica.outstanding_prefill_tokens == 1500
    for request in requests:  # failed, cancelled, refused upstream: no first token
        load.completed(pol, request, replica)
    assert (replica.outstanding_requests, replica.outstanding_prefill_tokens) == (0, 0)
    assert replica.dispatched == 3
