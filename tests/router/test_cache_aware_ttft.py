"""``cache_aware_ttft``: routing priced in seconds to the first token, from a cost profile."""

import numpy as np
import pytest

from loadtest.replay import ReplayConfig
from replica.api.cost_model import PROFILES
from replica.engine import Engine, EngineConfig
from replica.sequence import EngineRequest
from router.core import ReplicaState
from router.fleet import load
from router.policies import PolicyConfig, make_policy
from tests.router.test_policies import fleet, request
from tests.shared import FakeClock, prompt


def ttft_policy(clock: FakeClock | None = None, **config):
    return make_policy(
        "cache_aware_ttft",
        clock or FakeClock(),
        np.random.default_rng(0),
        PolicyConfig.of(**config),
    )


def engine_ttft(engine: Engine, requests: list[EngineRequest]) -> float:
    """Seconds until the last of ``requests`` (submitted together) has its first token."""
    start, waiting = engine.now, {r.request_id for r in requests}
    for r in requests:
        engine.add_request(r)
    while waiting:
        waiting -= {out.request_id for out in engine.step().outputs}
    return engine.now - start


@pytest.mark.parametrize(
    "cached, uncached", [(0, 64), (1024, 32), (0, 512), (0, 2048), (1024, 2048), (0, 16384)]
)
def test_an_idle_replicas_predicted_first_token_is_the_engines(cached, uncached):
    engine = Engine(EngineConfig(num_blocks=4096))
    if cached:
        engine_ttft(engine, [EngineRequest("warm", prompt(cached), 1)])
        while engine.has_unfinished:
            engine.step()
    tokens = np.concatenate((prompt(cached), prompt(uncached, 50_000)))
    measured = engine_ttft(engine, [EngineRequest("r", tokens, 1)])
    predicted = ttft_policy().first_token_s(ReplicaState("r", 4096), cached, uncached)
    # 16k tokens take the engine two steps of 8,192: the same work, a step's overhead more.
    assert predicted == pytest.approx(measured, rel=0.01)


def test_the_prefill_queued_ahead_is_priced_as_the_engine_computes_it():
    engine = Engine(EngineConfig(num_blocks=4096))
    ahead, mine = EngineRequest("ahead", prompt(4096), 1), EngineRequest("me", prompt(512, 9e5), 1)
    measured = engine_ttft(engine, [ahead, mine])  # one step computes both
    policy, busy = ttft_policy(), ReplicaState("r", 4096)
    queued = request(prompt(4096), "ahead")
    queued.predicted_cached_tokens = 0
    load.dispatched(policy, queued, busy)
    assert policy.first_token_s(busy, 0, 512) == pytest.approx(measured, rel=0.01)
    # Another gateway's prompt is known by its length alone, not its attention.
    reported = ReplicaState("r", 4096, outstanding_requests=1, outstanding_prefill_tokens=4096)
    assert measured * 0.85 < policy.first_token_s(reported, 0, 512) < measured


def test_a_long_uncached_prompt_costs_more_than_its_length_says():
    policy, idle = ttft_policy(), ReplicaState("r", 4096)
    short, long = (policy.first_token_s(idle, 0, n) for n in (8192, 32768))
    assert long > 4.5 * short  # attention grows with the square of the prompt


def test_it_moves_a_short_history_off_a_replica_whose_kv_is_full():
    clock = FakeClock()
    replicas, policy = fleet(2, capacity=1024), ttft_policy(clock)
    long_lived = request(prompt(300, 70_000), "long-lived")
    load.dispatched(policy, long_lived, replicas[1])
    clock.now += 30.0  # requests here live 30 s
    load.completed(policy, long_lived, replicas[1])
    history = prompt(300)
    first = request(history, "turn-1")
    home = replicas[0]
    load.dispatched(policy, first, home)
    load.completed(policy, first, home)
    follow_up = request(np.concatenate((history, prompt(100, 99_000))), "turn-2")
    for replica in replicas:
        replica.outstanding_requests, replica.free_blocks = 20, 1024
    assert policy.choose(follow_up, replicas) is home  # blocks free: the history's replica
    home.free_blocks = 0  # its pool full of running requests: waiting for blocks costs
    assert policy.choose(follow_up, replicas) is not home
    assert follow_up.predicted_cached_tokens == 0
    token_weights = make_policy("cache_aware", clock, np.random.default_rng(0))
    token_weights.on_dispatch(first, home)
    assert token_weights.choose(follow_up, replicas) is home  # it sees no full pool


def test_it_prices_with_the_engines_profile_or_a_calibrated_file(tmp_path):
    fleet_config = ReplayConfig(profile="llama3-8b-a100", max_num_batched_tokens=2048)
    assert fleet_config.routing.ttft.cost_profile == "llama3-8b-a100"
    assert fleet_config.routing.ttft.step_token_budget == 2048
    path = tmp_path / "calibrated.json"
    PROFILES["llama3-8b-a100"].save(path)
    assert ttft_policy(cost_profile=str(path)).profile == PROFILES["llama3-8b-a100"]
    assert ttft_policy().profile == PROFILES["llama3-8b-h100"]  # the simulated replica's
    with pytest.raises(ValueError, match="--cost-profile: unknown cost profile 'h200'"):
        PolicyConfig.of(cost_profile="h200")
