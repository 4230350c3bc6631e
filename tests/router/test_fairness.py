"""Fair admission: when replicas are full, the next request is the most urgent class's,
then the least-served tenant's, charged in the prefill it really cost."""

from __future__ import annotations

import asyncio
import itertools

import httpx
import pytest

from deploy.processes import running
from replica.api import stats as stats_codec
from router.core import RoutingRequest
from router.fair.admission import AdmissionQueue
from router.fair.fairness import FairShare
from router.fair.tenants import ApiKeys, Tenant
from router.stats import GatewayStats
from tests.shared import gateway_reaches, in_flight


async def served_order(queue: AdmissionQueue, arrivals: list[tuple[str | None, int]]) -> list[int]:
    """Queue ``arrivals`` (tenant, class rank) in order, free one slot at a time, and
    return the order (indices into ``arrivals``) in which they were woken."""
    order: list[int] = []

    async def wait(i: int, tenant: str | None, rank: int) -> None:
        await queue.wait_turn(queue.deadline(), request(tenant, rank))
        order.append(i)

    tasks = []
    for i, (tenant, rank) in enumerate(arrivals):
        tasks.append(asyncio.create_task(wait(i, tenant, rank)))
        await asyncio.sleep(0)  # each in the queue before the next arrives
    for served in range(1, len(arrivals) + 1):
        queue.slot_freed()
        await woken(order, served)
    await asyncio.gather(*tasks)
    return order


def request(tenant: str | None, rank: int = 0) -> RoutingRequest:
    return RoutingRequest("r", 10, [], tenant=tenant, priority=rank)


async def woken(order: list, count: int) -> None:
    """Let the loop run until ``count`` waiters have woken and done their work."""
    while len(order) < count:
        await asyncio.sleep(0)


def test_without_tenants_or_classes_the_queue_is_first_come_first_served():
    queue = AdmissionQueue(max_queued=16, timeout_s=5)
    assert asyncio.run(served_order(queue, [(None, 0)] * 6)) == list(range(6))


def test_the_least_served_tenant_goes_next_and_idle_time_banks_no_credit():
    """VTC's counters (no decay): a tenant back from idle is lifted to the flood's."""
    fair = FairShare(half_life_s=0)
    fair.charge("flood", 10_000)  # it has had the fleet to itself
    fair.charge("steady", 500)  # long ago: it has been idle since
    queue = AdmissionQueue(max_queued=16, timeout_s=5, fair=fair)

    async def charged_as_served() -> list[str]:
        order: list[str] = []

        async def wait(tenant: str) -> None:
            await queue.wait_turn(queue.deadline(), request(tenant))
            order.append(tenant)
            fair.charge(tenant, 1_000)  # what its prefill cost

        tasks = [asyncio.create_task(wait(t)) for t in ["flood"] * 4 + ["steady"] * 2]
        await asyncio.sleep(0)
        assert fair.standing("steady") == 10_000  # lifted to flood's: no banked credit
        for served in range(1, len(tasks) + 1):
            queue.slot_freed()
            await woken(order, served)
        await asyncio.gather(*tasks)
        return order

    # Each tenant's turn comes when its service is the least (a tie: the older queue).
    expected = ["flood", "steady", "flood", "steady", "flood", "flood"]
    assert asyncio.run(charged_as_served()) == expected


def test_service_decays_so_a_light_tenant_goes_before_a_flood():
    """With a half-life, what counts is recent service: a tenant that sends little
    goes first whenever it waits, and old service fades (no lift is needed: idle
    time banks at most what decays away)."""
    now = [0.0]
    fair = FairShare(half_life_s=10, clock=lambda: now[0])
    fair.charge("flood", 10_000)
    fair.charge("steady", 500)
    now[0] = 10.0
    assert fair.standing("flood") == pytest.approx(5_000)
    assert fair.standing("steady") == pytest.approx(250)
    queue = AdmissionQueue(max_queued=16, timeout_s=5, fair=fair)
    arrivals = [("flood", 0)] * 3 + [("steady", 0)] * 2
    assert asyncio.run(served_order(queue, arrivals)) == [3, 4, 0, 1, 2]
    now[0] = 1_000.0  # long idle: both back at nothing, no credit banked
    assert fair.standing("flood") < 1e-20 and fair.standing("steady") < 1e-20
    with pytest.raises(ValueError, match="half-life"):
        FairShare(half_life_s=-1)


def test_a_tenant_beyond_its_share_may_not_take_the_reserve_and_is_passed_over():
    now = [0.0]
    fair = FairShare(half_life_s=30, clock=lambda: now[0])
    flood, light = request("flood"), request("light")
    for _ in range(6):
        fair.dispatched(flood)
        fair.charge("flood", 1_000)
    assert fair.within_share(flood)  # alone: the whole fleet is its share
    fair.dispatched(light)
    fair.ended(light, cached=0, generated=0)
    assert fair.in_flight["light"] == 0 and fair.in_flight["flood"] == 6
    # light was active within the half-life: flood has had more than the average
    assert not fair.within_share(flood) and fair.within_share(light)
    now[0] = 31.0  # light long gone and flood's requests ended: flood alone again
    for _ in range(6):
        fair.ended(flood, cached=None, generated=0)
    assert fair.within_share(flood)
    assert FairShare("fcfs").within_share(flood) and fair.within_share(request(None))
    weighted = FairShare(half_life_s=30, clock=lambda: now[0])
    gold = RoutingRequest("g", 10, [], tenant="gold", weight=3)
    for tenant, weight in (gold, 3.0), (flood, 1.0):
        weighted.dispatched(tenant)
        weighted.charge(tenant.tenant, 2_990, weight)  # 3,000 tokens each in all
    assert weighted.within_share(gold) and not weighted.within_share(flood)

    # A freed reserve slot goes to the first waiter that may take it.
    queue = AdmissionQueue(16, 5, FairShare(), can_serve=lambda r: r.tenant != "flood")
    arrivals = [("flood", 0), ("light", 0)]

    async def first_woken() -> str:
        tasks = [
            asyncio.create_task(queue.wait_turn(queue.deadline(), request(t, rank)))
            for t, rank in arrivals
        ]
        await asyncio.sleep(0)
        queue.slot_freed()
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        return arrivals[tasks.index(done.pop())][0]

    assert asyncio.run(first_woken()) == "light"
    assert len(queue) == 0


def test_interactive_requests_go_before_batch_ones_whatever_the_service():
    fair = FairShare()
    fair.charge("chat", 50_000)  # far more service than the batch tenant
    queue = AdmissionQueue(max_queued=16, timeout_s=5, fair=fair)
    arrivals = [("batch", 1)] * 3 + [("chat", 0)] * 2
    assert asyncio.run(served_order(queue, arrivals)) == [3, 4, 0, 1, 2]


def test_weights_divide_the_charge():
    fair = FairShare(half_life_s=0)
    fair.charge("gold", 3_000, weight=3)
    fair.charge("bronze", 3_000)
    assert fair.standing("gold") == 1_000 and fair.standing("bronze") == 3_000
    assert fair.charged_tokens["gold"] == fair.charged_tokens["bronze"] == 3_000


def test_keys_carry_a_weight_a_class_and_a_cache_budget(tmp_path):
    path = tmp_path / "keys.txt"
    path.write_text(
        "k1 acme weight=2\nk2 batchco class=batch\nk3 ops admin weight=0.5\nk5 rag budget=0.25\n"
    )
    keys = ApiKeys.load(str(path), env={"PREFIX_ROUTER_API_KEYS": "k4=bulk:class=batch:weight=4"})
    assert keys.tenant("Bearer k1") == Tenant("acme", weight=2.0)
    assert keys.tenant("Bearer k2") == Tenant("batchco", priority="batch")
    assert keys.tenant("Bearer k3") == Tenant("ops", admin=True, weight=0.5)
    assert keys.tenant("Bearer k4") == Tenant("bulk", weight=4.0, priority="batch")
    assert keys.tenant("Bearer k5") == Tenant("rag", cache_budget=0.25)
    for bad in ("k acme weight=0", "k acme class=urgent", "k acme root", "k acme budget=1.5"):
        path.write_text(bad + "\n")
        with pytest.raises(ValueError, match=r"keys.txt:1: bad .*expected KEY TENANT"):
            ApiKeys.load(str(path), env={})


FLOOD, STEADY, BATCH, ADMIN = "flood-key", "steady-key", "batch-key", "admin-key"


@pytest.mark.slow
def test_through_the_gateway_a_steady_tenant_passes_a_flood_and_batch_waits(tmp_path):
    """One slow replica taking one request at a time: a tenant that queued eight
    requests does not keep a later tenant's one behind all of them; a batch request
    queued first waits behind an interactive one queued after it."""
    keys = tmp_path / "keys.txt"
    keys.write_text(
        f"{FLOOD} flood\n{STEADY} steady\n{BATCH} nightly class=batch\n{ADMIN} ops admin\n"
    )
    with running(["replica", "--speedup", "1"]) as (replica,):
        one_at_a_time = ["--max-outstanding-per-replica", "1"]
        gateway = ["gateway", f"--backend={replica}", "--api-keys-file", str(keys), *one_at_a_time]
        with running(gateway) as (url,):
            order = asyncio.run(finishing_order(url))
            headers = {"authorization": f"Bearer {STEADY}", "x-priority": "now"}
            body = {"prompt": "hi", "max_tokens": 1}
            bad = httpx.post(f"{url}/v1/completions", json=body, headers=headers)
            admin = {"authorization": f"Bearer {ADMIN}"}
            stats = stats_codec.decode(
                GatewayStats, httpx.get(f"{url}/stats", headers=admin).content
            )
    assert bad.status_code == 400 and "unknown request class 'now'" in bad.text
    steady, batch = order.index("steady"), order.index("batch")
    # FIFO would serve it ninth (after all eight of flood's); fairly, once flood's
    # service passes its own, within the first few.
    assert steady <= 3, order
    assert order.index("chat") < batch, order
    assert len(order) == 11
    # each was charged the prefill the engine did not have cached, and its 24 tokens
    # (flood's first, 240)
    for name, tenant in stats.tenants.items():
        uncached = tenant.prompt_tokens - tenant.cached_tokens
        generated = 24 * tenant.requests + (240 - 24 if name == "flood" else 0)
        assert tenant.charged_tokens == uncached + generated, name
    print("finishing order:", " ".join(order))


async def queued(client: httpx.AsyncClient, url: str, count: int) -> None:
    """Until the gateway's queue holds ``count`` requests (every one sent so far but
    the one running: each arrives after those before it, whatever the machine's speed)."""
    await gateway_reaches(client, url, lambda stats: stats.queued == count)


async def finishing_order(url: str) -> list[str]:
    done: list[str] = []
    serial = itertools.count()

    async def send(
        client: httpx.AsyncClient, key: str, label: str, header: str = "", tokens: int = 24
    ) -> None:
        headers = {"authorization": f"Bearer {key}"}
        if header:
            headers["x-priority"] = header
        # a prompt of its own each, as costly as any other's: the order is fairness alone
        prompt = f"{next(serial)} {label} asks: " + "tell me about caches. " * 20
        body = {"prompt": prompt, "max_tokens": tokens, "ignore_eos": True}
        response = await client.post(f"{url}/v1/completions", json=body, headers=headers)
        response.raise_for_status()
        done.append(label)

    async with httpx.AsyncClient(timeout=60) as client:
        # flood's first runs long enough for the others to be queued in order behind it
        tasks = [asyncio.create_task(send(client, FLOOD, "flood", tokens=240))]
        await gateway_reaches(client, url, lambda stats: in_flight(stats) == 1)
        tasks += [asyncio.create_task(send(client, FLOOD, "flood")) for _ in range(7)]
        await queued(client, url, 7)
        tasks.append(asyncio.create_task(send(client, STEADY, "steady")))
        await queued(client, url, 8)
        # a batch key cannot ask for more urgency than its class
        tasks.append(asyncio.create_task(send(client, BATCH, "batch", "interactive")))
        await queued(client, url, 9)
        # steady again, marked interactive: it must still go before the batch request
        tasks.append(asyncio.create_task(send(client, STEADY, "chat", "interactive")))
        await asyncio.gather(*tasks)
    return done
