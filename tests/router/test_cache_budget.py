"""Tenant cache budgets: a tenant's new prefix is kept off replicas where it holds its
budget, a hit is not, and a tenant at its budget everywhere churns its own blocks."""

import httpx
import numpy as np
import pytest

from deploy.processes import running
from replica.api.identity import DEFAULT_MODEL, block_hashes, identity_seed, prefix_keys
from replica.api.kv_events import KVEvent
from router.core import ReplicaState, RoutingRequest
from router.fair.cache_budget import within_budget
from router.policies import PolicyConfig, make_policy
from tests.shared import FakeClock, prompt, wait_until_checked, wait_until_indexed

BLOCK, CAPACITY = 16, 1000


def seed(salt: str | None) -> int:
    return identity_seed(DEFAULT_MODEL, salt)


def request(tokens: np.ndarray, salt: str, budget: float | None) -> RoutingRequest:
    hashes = prefix_keys(tokens, BLOCK, 4, seed(salt))
    return RoutingRequest("r", len(tokens), hashes, tenant=salt, cache_budget=budget)


def holds(policy, replica: ReplicaState, tokens: np.ndarray, salt: str | None) -> None:
    """The replica's events say it holds ``tokens`` under ``salt``."""
    hashes = tuple(block_hashes(tokens, BLOCK, seed(salt)))
    data = tokens[: len(hashes) * BLOCK].tobytes()
    event = KVEvent(1, "stored", hashes, None, (), "GPU", data, salt)
    policy.on_kv_events(replica, [event])


def scene(n: int = 3):
    policy = make_policy("cache_aware", FakeClock(), np.random.default_rng(0), PolicyConfig())
    replicas = [ReplicaState(f"replica-{i}", CAPACITY) for i in range(n)]
    for replica in replicas:
        policy.on_replica_added(replica)
    return policy, replicas


def test_a_new_prefix_goes_where_its_tenant_is_below_its_budget():
    policy, replicas = scene()
    old = prompt(BLOCK * 300)  # 300 of 1,000 blocks: 30%
    holds(policy, replicas[0], old, "acme")
    holds(policy, replicas[1], prompt(BLOCK * 900, 50_000), "globex")  # another's: no matter
    new = request(prompt(BLOCK * 10, 90_000), "acme", budget=0.25)
    assert within_budget(policy, new, replicas, ["acme"]) == replicas[1:]
    # Within its budget, or without one, every replica stays a candidate.
    for budget in (0.5, None):
        other = request(prompt(160, 90_000), "acme", budget)
        assert within_budget(policy, other, replicas, ["acme"]) == replicas
    # The blocks of its other salts count: at 30% + 10%, 0.35 is passed on replica 0.
    holds(policy, replicas[0], prompt(BLOCK * 100, 70_000), "acme-x")
    wider = request(prompt(160, 90_000), "acme", 0.35)
    assert within_budget(policy, wider, replicas, ["acme"]) == replicas
    assert within_budget(policy, wider, replicas, ["acme", "acme-x"]) == replicas[1:]


def test_a_replica_holding_the_prefix_stays_a_candidate_over_the_budget():
    policy, replicas = scene()
    history = prompt(BLOCK * 300)
    holds(policy, replicas[0], history, "acme")
    follow_up = request(np.concatenate((history, prompt(40, 90_000))), "acme", budget=0.25)
    assert within_budget(policy, follow_up, replicas, ["acme"]) == replicas
    assert policy.choose(follow_up, replicas) is replicas[0]  # its hit


def test_at_its_budget_everywhere_a_tenant_churns_where_it_holds_the_most():
    policy, replicas = scene()
    for replica, blocks in zip(replicas, (300, 500, 400), strict=True):
        holds(policy, replica, prompt(BLOCK * blocks, blocks), "acme")
    new = request(prompt(BLOCK * 10, 90_000), "acme", budget=0.25)
    assert within_budget(policy, new, replicas, ["acme"]) == [replicas[1]]
    assert policy.choose(new, within_budget(policy, new, replicas, ["acme"])) is replicas[1]


def test_replicas_of_unknown_content_or_size_are_never_excluded():
    policy, replicas = scene()
    holds(policy, replicas[0], prompt(BLOCK * 300), "acme")
    unsized = ReplicaState("unsized", 0)
    approximate = ReplicaState("approximate", CAPACITY, precise=False)
    for replica in (unsized, approximate):
        policy.on_replica_added(replica)
        holds(policy, replica, prompt(BLOCK * 300), "acme")
    new = request(prompt(160, 90_000), "acme", budget=0.1)
    fleet = [replicas[0], unsized, approximate]
    assert within_budget(policy, new, fleet, ["acme"]) == [unsized, approximate]
    # A policy without an index has nothing to count: every candidate stays.
    blind = make_policy("round_robin", FakeClock(), np.random.default_rng(0), PolicyConfig())
    assert within_budget(blind, new, fleet, ["acme"]) == fleet


@pytest.mark.slow
def test_through_the_gateway_a_tenant_at_its_budget_keeps_its_new_prompts_together(tmp_path):
    keys = tmp_path / "keys"
    keys.write_text("k-rag rag budget=0.1\nk-ops ops admin\n")
    replica = ["replica", "--speedup", "20", "--num-blocks", "1000"]
    with running(replica, replica, replica) as replicas:
        backends = [f"--backend={url}" for url in replicas]
        with running(["gateway", *backends, f"--api-keys-file={keys}"]) as (url,):
            wait_until_checked(url, backends=3)
            served = []
            for document in range(7):  # each longer than the last: no two replicas tie
                text = f"Document {document}: " + "the fund's report. " * (400 + 25 * document)
                response = httpx.post(
                    f"{url}/v1/completions",
                    json={"prompt": text, "max_tokens": 1},
                    headers={"authorization": "Bearer k-rag"},
                    timeout=30,
                )
                assert response.status_code == 200, response.text
                served.append(response.headers["x-prefix-router-replica"])
                wait_until_indexed(url, key="k-ops")  # counted before the next choice
    # Each of the first three fills its replica past the budget (100 blocks), so the next
    # goes where it is below; then, at its budget everywhere, it churns where it holds most.
    assert len(set(served[:3])) == 3
    assert served[3:] == [served[2]] * 4
