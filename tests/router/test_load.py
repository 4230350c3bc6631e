"""Load accounting, shared by the gateway and the replayer: every path returns it to zero."""

import numpy as np

from router.core import ReplicaState, RoutingRequest
from router.fleet import load
from router.policies import PolicyConfig, make_policy
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


def test_a_replicas_report_plus_our_requests_since_is_the_load_balanced_on():
    from replica.api.stats import LoadReport

    replica, pol = ReplicaState("r", 64), policy()
    early = RoutingRequest("early", 400, [1])
    load.dispatched(pol, early, replica, now=10.0)
    assert (replica.load_requests, replica.load_prefill_tokens) == (1, 400)  # no report: ours
    # The replica saw ours and two of another gateway's requests, at 10.5.
    load.reported(replica, LoadReport(running=2, waiting=1, prefill_tokens=900, ts=10.5))
    assert (replica.load_requests, replica.load_prefill_tokens) == (3, 900)
    assert replica.free_blocks is None  # the report did not say
    load.reported(replica, LoadReport(2, 1, 900, ts=10.5, free_blocks=40))
    assert replica.free_blocks == 40
    late = RoutingRequest("late", 300, [2])
    load.dispatched(pol, late, replica, now=10.6)  # not in the report: counted on top
    assert (replica.load_requests, replica.load_prefill_tokens) == (4, 1200)
    load.prefilled(late, replica)
    load.prefilled(early, replica)  # in the report already: the next report tells
    assert (replica.load_requests, replica.load_prefill_tokens) == (4, 900)
    load.completed(pol, late, replica)
    load.completed(pol, early, replica)
    assert (replica.load_requests, replica.load_prefill_tokens) == (3, 900)
    # A report older than a request still in flight counts it on top again.
    again = RoutingRequest("again", 200, [3])
    load.dispatched(pol, again, replica, now=11.0)
    load.reported(replica, LoadReport(running=0, waiting=0, prefill_tokens=0, ts=10.9))
    assert (replica.load_requests, replica.load_prefill_tokens) == (1, 200)
    load.reported(replica, None)  # the stream went stale: our own counts again
    assert (replica.load_requests, replica.load_prefill_tokens) == (1, 200)
    assert replica.free_blocks is None
    load.completed(pol, again, replica)
    assert replica.in_flight == {} and replica.outstanding_requests == 0
