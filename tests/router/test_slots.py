"""Which replicas have a slot for a request: the cap, the reserve kept from a tenant
beyond its share, the engines' own queues it may not lengthen, and the overflow that
keeps a light tenant on its cache."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping

import httpx
import pytest

from deploy.processes import running
from replica.api.stats import LoadReport
from router.core import ReplicaState, RoutingRequest
from router.fair.fairness import FairShare
from router.fair.slots import with_free_slot
from router.fleet import load
from tests.router.test_policies import dispatch, fleet, policy, request
from tests.shared import gateway_reaches, in_flight, prompt

CAP, RESERVE = 4, 2


def shares() -> FairShare:
    """A flood far beyond its share beside a light tenant (both active now)."""
    now = [0.0]
    fair = FairShare(half_life_s=30, clock=lambda: now[0])
    for tenant, tokens in ("flood", 10_000), ("light", 10):
        fair.dispatched(RoutingRequest("r", 10, [], tenant=tenant))
        fair.charge(tenant, tokens)
    return fair


def filled(replicas: list[ReplicaState], counts: list[int]) -> list[ReplicaState]:
    for replica, count in zip(replicas, counts, strict=True):
        replica.outstanding_requests = count
    return replicas


def names(replicas: list[ReplicaState]) -> list[str]:
    return [r.replica_id for r in replicas]


def free(
    request: RoutingRequest,
    replicas: list[ReplicaState],
    held: Callable[[], Mapping[str, int]],
    fair: FairShare | None = None,
    reserve: int = RESERVE,
) -> list[str]:
    return names(with_free_slot(request, replicas, fair or shares(), CAP, reserve, held))


def test_a_tenant_beyond_its_share_leaves_the_reserve_free():
    replicas = filled(fleet(4), [0, 1, 2, 4])
    flood = RoutingRequest("f", 10, [], tenant="flood")
    held = lambda: {"replica-3": 10}  # noqa: E731  (its home is full)
    assert free(flood, replicas, held) == ["replica-0", "replica-1"]  # below CAP - RESERVE
    # the reserve never takes a replica's last slot
    assert free(flood, replicas, held, reserve=9) == ["replica-0"]


def test_a_tenant_beyond_its_share_stays_on_its_homes_while_one_has_a_slot():
    replicas = filled(fleet(4), [0, 1, 2, 4])
    flood = RoutingRequest("f", 10, [], tenant="flood")
    # it holds the most on replica-1: there, not on replica-0 (emptier, but it would
    # compute the flood's prefix there, stalling that replica's lighter tenants)
    assert free(flood, replicas, lambda: {"replica-1": 64, "replica-0": 16}) == ["replica-1"]
    both = {"replica-0": 64, "replica-1": 64, "replica-3": 64}
    assert free(flood, replicas, lambda: both) == ["replica-0", "replica-1"]
    # its homes full (below CAP - RESERVE no more): it spreads, as before
    assert free(flood, replicas, lambda: {"replica-2": 64}) == ["replica-0", "replica-1"]
    assert free(flood, replicas, dict) == ["replica-0", "replica-1"]  # held nowhere
    # within its share, a tenant places freely
    light = RoutingRequest("l", 10, [], tenant="light")
    assert free(light, replicas, lambda: {"replica-1": 64}) == [
        "replica-0",
        "replica-1",
        "replica-2",
    ]


def engines(*loads: tuple[int, int, int]) -> list[ReplicaState]:
    """Replicas whose engines said ``(running, waiting)`` and took ``sent`` since, each
    running 8 sequences at most."""
    replicas = fleet(len(loads))
    for replica, (running_, waiting, sent) in zip(replicas, loads, strict=True):
        replica.max_num_seqs = 8
        load.reported(replica, LoadReport(running_, waiting, 0))
        replica.requests_since_report = sent
    return replicas


def test_a_tenant_beyond_its_share_adds_nothing_to_an_engines_queue_past_the_bound():
    """Far below the gateway's cap: replica-0's engine runs its 8 less the reserve,
    replica-1's keeps 4 waiting (its KV cache full), replica-3's 3 and one sent since;
    replica-2's has 3 waiting, one more may join them."""
    replicas = engines((6, 0, 0), (1, 4, 0), (2, 3, 0), (1, 3, 1))
    flood = RoutingRequest("f", 10, [], tenant="flood")
    light = RoutingRequest("l", 10, [], tenant="light")

    def open_to(request: RoutingRequest, held: Mapping[str, int], bound: int = 4) -> list[str]:
        slots = with_free_slot(request, replicas, shares(), 128, RESERVE, lambda: held, bound)
        return names(slots)

    assert open_to(flood, {}) == ["replica-2"]
    assert open_to(flood, {}, bound=0) == names(replicas)  # engines not asked: the cap alone
    assert open_to(light, {}) == names(replicas)  # within its share: it may queue there
    # its home's engine queues: it waits at the gateway rather than compute its prefix
    # on a lighter tenant's replica
    assert open_to(flood, {"replica-1": 64}) == []
    assert open_to(flood, {"replica-1": 64, "replica-2": 64}) == ["replica-2"]
    replicas[1].max_num_seqs = None  # not said (vLLM's card): its queue alone says
    load.reported(replicas[1], LoadReport(5, 3, 0))
    assert open_to(flood, {"replica-1": 64}) == ["replica-1"]


def test_a_light_tenant_goes_over_the_cap_on_its_home_only_and_to_twice_the_cap_at_most():
    replicas = filled(fleet(4), [1, 4, 7, 8])
    light = RoutingRequest("l", 10, [], tenant="light")
    held = {"replica-1": 64, "replica-2": 64, "replica-3": 64, "replica-0": 16}
    # replica-0 below the cap; replicas 1 and 2 hold the most and are below twice the
    # cap; replica-3 holds as much but is at twice the cap
    assert free(light, replicas, lambda: held) == ["replica-0", "replica-1", "replica-2"]
    held["replica-2"] = 32  # replica-1 alone holds the most: the one that may overflow
    assert free(light, replicas, lambda: held) == ["replica-0", "replica-1"]
    assert free(light, replicas, dict) == ["replica-0"]  # held nowhere: the cap is the cap


def test_without_tenants_or_fairness_nobody_goes_over_the_cap():
    replicas = filled(fleet(2), [4, 1])
    held = lambda: {"replica-0": 64}  # noqa: E731
    untenanted = RoutingRequest("u", 10, [], tenant=None)
    light = RoutingRequest("l", 10, [], tenant="light")
    assert free(untenanted, replicas, held) == ["replica-1"]
    assert free(light, replicas, held, fair=FairShare("fcfs")) == ["replica-1"]
    # without a reserve, a light tenant still keeps its home
    assert free(light, replicas, held, reserve=0) == ["replica-1", "replica-0"]


def test_a_light_tenants_next_turn_stays_on_the_full_replica_that_holds_its_history():
    pol, replicas = policy("cache_aware"), fleet(2)
    history = prompt(1_024)
    first = request(history, "turn-1")
    first.tenant = "light"
    home = dispatch(pol, first, replicas)
    load.completed(pol, first, home)
    other = next(r for r in replicas if r is not home)
    filled(replicas, [CAP if r is home else 0 for r in replicas])  # a flood filled its home
    turn = request(prompt(1_100), "turn-2")  # the same history and a new question
    turn.tenant = "light"
    assert pol.holders(turn)[home.replica_id] >= 1_024 - 16
    open_ = with_free_slot(turn, replicas, shares(), CAP, RESERVE, lambda: pol.holders(turn))
    assert names(open_) == [other.replica_id, home.replica_id]
    assert pol.choose(turn, open_) is home
    assert turn.predicted_cached_tokens and turn.predicted_cached_tokens >= 1_024 - 16
    # a policy without an index predicts nothing held, so nothing goes over the cap
    assert policy("round_robin").holders(turn) == {}


@pytest.mark.slow
def test_through_the_gateway_a_light_tenants_turn_stays_on_its_full_replica(tmp_path):
    """Two replicas taking 2 requests each, 1 of them kept from a tenant beyond its
    share: the flood holds one on each, the light tenant's first turn fills its home,
    and its next turn still goes there, over the cap, instead of to the other replica
    (free, but cold)."""
    keys = tmp_path / "keys.txt"
    keys.write_text("flood-key flood\nlight-key light\nops-key ops admin\n")
    replica = ["replica", "--speedup", "0.2"]
    with running(replica, replica) as replicas:
        backends = [f"--backend={u}" for u in replicas]
        limits = ["--max-outstanding-per-replica", "2", "--fair-reserve-per-replica", "1"]
        gateway = ["gateway", *backends, "--api-keys-file", str(keys), *limits]
        with running(gateway) as (url,):
            home, held, second = asyncio.run(light_turns(url))
    assert held[home] == 2 and sum(held.values()) == 3, held  # home full, the other not
    assert second == home


async def light_turns(url: str) -> tuple[str, dict[str, int], str]:
    """The light tenant's home, the requests each replica held before its next turn,
    and where that turn went."""
    history = "Our conversation so far: " + "the cache keeps what it computed. " * 120

    async def ask(client: httpx.AsyncClient, key: str, prompt: str, tokens: int) -> str:
        body = {"prompt": prompt, "max_tokens": tokens, "ignore_eos": True}
        headers = {"authorization": f"Bearer {key}"}
        response = await client.post(f"{url}/v1/completions", json=body, headers=headers)
        response.raise_for_status()
        return response.headers["x-prefix-router-replica"]

    async with httpx.AsyncClient(timeout=60) as client:
        for i in range(4):  # the flood's service passes the light tenant's
            await ask(client, "flood-key", f"{i} flood: " + "a new question. " * 200, 1)
        home = await ask(client, "light-key", history + " Q0?", 1)
        running_ = [  # long enough to be in flight below
            asyncio.create_task(ask(client, "flood-key", f"long {i}", 120)) for i in range(2)
        ]
        # one on each replica (the flood may take no more), then the light turn on its home
        await gateway_reaches(client, url, lambda s: in_flight(s) == 2, "ops-key")
        running_.append(asyncio.create_task(ask(client, "light-key", history + " Q1?", 120)))
        stats = await gateway_reaches(client, url, lambda s: in_flight(s) == 3, "ops-key")
        held = {b.replica_id: b.outstanding_requests for b in stats.backends}
        second = await ask(client, "light-key", history + " Q2?", 1)
        for task in running_:
            task.cancel()
        await asyncio.gather(*running_, return_exceptions=True)
    return home, held, second


@pytest.mark.slow
def test_through_the_gateway_a_flood_waits_at_the_gateway_not_in_the_engines(tmp_path):
    """Two replicas whose engines run 2 requests at once, the gateway's cap (128) far
    off: a flood's 8 long requests take one sequence on each engine, the reserve the
    other, and the rest wait in the gateway's fair queue, which serves a light tenant's
    request at once: it ends before any of the flood's. The flood's queue drains as the
    engines report room (nothing else would wake it), every request answered."""
    keys = tmp_path / "keys.txt"
    keys.write_text("flood-key flood\nlight-key light\nops-key ops admin\n")
    replica = ["replica", "--max-num-seqs", "2"]
    with running(replica, replica) as replicas:
        gateway = ["gateway", *[f"--backend={u}" for u in replicas], "--api-keys-file", str(keys)]
        with running(gateway) as (url,):
            ended, queued, engines = asyncio.run(flood_and_light(url))
    assert queued == 6  # 8 less the two running
    assert all(b.max_num_seqs == 2 and b.outstanding_requests == 1 for b in engines)
    assert ended.index("light") == 0, ended
    assert ended.count("flood") == 8


async def flood_and_light(url: str) -> tuple[list[str], int, list]:
    """Who ended in which order, the gateway's queue once the flood is in, and its
    backends then."""
    ended: list[str] = []

    async def ask(client: httpx.AsyncClient, who: str, prompt: str, tokens: int) -> None:
        body = {"prompt": prompt, "max_tokens": tokens, "ignore_eos": True}
        headers = {"authorization": f"Bearer {who}-key"}
        response = await client.post(f"{url}/v1/completions", json=body, headers=headers)
        response.raise_for_status()
        ended.append(who)

    async with httpx.AsyncClient(timeout=120) as client:
        await ask(client, "light", "light: hello", 1)
        for i in range(4):  # the flood's service passes the light tenant's
            await ask(client, "flood", f"{i} flood: " + "a new question. " * 200, 1)
        ended.clear()
        flood = [
            asyncio.create_task(ask(client, "flood", f"long {i}: " + "more words. " * 50, 200))
            for i in range(8)
        ]
        stats = await gateway_reaches(client, url, lambda s: s.queued == 6, "ops-key")
        await ask(client, "light", "light: a short question", 4)
        await asyncio.gather(*flood)
    return ended, stats.queued, stats.backends
