"""`serve --min-replicas 1 --max-replicas 2`: the fleet grows under a burst and shrinks
after it, a replica leaving only once its requests have ended, none failing; a
disaggregated fleet's pools each on their own load."""

from __future__ import annotations

import asyncio
import shlex
import time

import httpx
import pytest

from tests.deploy.test_serve import serving

pytestmark = [pytest.mark.slow, pytest.mark.ray]

SCALING = shlex.split(
    "--replicas 1 --replica-speedup 0.2 --min-replicas 1 --max-replicas 2"
    " --target-ongoing-requests 4 --upscale-delay-s 1 --downscale-delay-s 3 --interval-s 0.5"
)


def test_the_fleet_grows_under_a_burst_and_shrinks_after_it_failing_nothing():
    values: list[dict[str, float]] = []
    with serving(*SCALING) as (url, process):
        assert process.stdout is not None
        seen, answers = asyncio.run(burst_then_trickle(url, cache_values=values))
    failed = [answer for answer in answers if answer[0] != 200]
    assert not failed and len(answers) > 20, len(answers)
    fleets = [sorted(replicas) for _, replicas in seen]
    assert fleets[0] == ["replica-0"] and ["replica-0", "replica-1"] in fleets  # it grew
    assert len(fleets[-1]) == 1  # and shrank
    grown = next(i for i, fleet in enumerate(fleets) if len(fleet) == 2)
    leaving = [i for i, (_, replicas) in enumerate(seen) if any(replicas.values())]
    assert leaving and leaving[0] > grown  # it drained before it went
    # It stopped the replica whose loss cost the caches least, as the gateway's
    # GET /admin/cache_values said just before (the other holds the trickle's long
    # shared prompt, asked for again and again), and kept the other.
    drained = next(r for r, draining in seen[leaving[0]][1].items() if draining)
    before = values[leaving[0] - 1]
    kept = next(r for r in before if r != drained)
    assert before[drained] < before[kept], before
    assert fleets[-1] == [kept]
    served = {replica for _, replica in answers}
    assert served == {"replica-0", "replica-1"}  # the new one served its share


PD_SCALING = shlex.split(
    "--prefill 1 --decode 1 --policy pd_always --replica-speedup 0.2 --min-replicas 1"
    " --max-replicas 2 --target-ongoing-requests 4 --upscale-delay-s 1 --downscale-delay-s 3"
    " --interval-s 0.5"
)


def test_a_disaggregated_fleet_grows_and_shrinks_its_busy_pool_alone():
    roles: dict[str, str] = {}
    with serving(*PD_SCALING) as (url, _):
        seen, answers = asyncio.run(burst_then_trickle(url, floor=2, roles=roles))
    assert all(answer[0] == 200 for answer in answers) and len(answers) > 20
    # long answers from short prompts: the decode pool's requests pile up, the
    # prefill pool's prompt tokens do not
    assert roles == {"replica-0": "prefill", "replica-1": "decode", "replica-2": "decode"}
    fleets = [sorted(replicas) for _, replicas in seen]
    assert ["replica-0", "replica-1", "replica-2"] in fleets  # the decode pool grew
    assert len(fleets[-1]) == 2 and "replica-0" in fleets[-1]  # and shrank
    assert {replica for _, replica in answers} == {"replica-1", "replica-2"}  # both decoded


async def burst_then_trickle(
    url: str,
    clients: int = 8,
    floor: int = 1,
    roles: dict[str, str] | None = None,
    cache_values: list[dict[str, float]] | None = None,
) -> tuple[list[tuple[float, dict[str, bool]]], list]:
    """``clients`` clients asking for 60 tokens at a time for 12 s, then one asking
    short questions after a long shared prompt until the fleet is back to ``floor``
    replicas; the fleet as ``/stats`` saw it every 0.25 s (replica -> draining) and
    every answer (status, replica). Each replica's role, as ``/stats`` said it, into
    ``roles``, and the gateway's ``/admin/cache_values`` at each look, into
    ``cache_values``, if given."""
    answers: list[tuple[int | str, str | None]] = []
    seen: list[tuple[float, dict[str, bool]]] = []
    started = time.monotonic()

    async def ask(client: httpx.AsyncClient, prompt: str, tokens: int) -> None:
        body = {"prompt": prompt, "max_tokens": tokens, "ignore_eos": True}
        try:
            response = await client.post(f"{url}/v1/completions", json=body)
            answers.append((response.status_code, response.headers.get("x-prefix-router-replica")))
        except httpx.HTTPError as error:
            answers.append((repr(error), None))

    async def client_loop(client: httpx.AsyncClient, index: int, until: float) -> None:
        turn = 0
        while time.monotonic() < until:
            await ask(client, f"client {index} turn {turn}: " + "tell me of caches. " * 30, 60)
            turn += 1

    async def watch(client: httpx.AsyncClient, stop: asyncio.Event) -> None:
        while not stop.is_set():
            backends = (await client.get(f"{url}/stats")).json()["backends"]
            if roles is not None:
                roles.update((b["replica_id"], b["role"]) for b in backends)
            seen.append(
                (time.monotonic() - started, {b["replica_id"]: b["draining"] for b in backends})
            )
            if cache_values is not None:
                cache_values.append((await client.get(f"{url}/admin/cache_values")).json())
            await asyncio.sleep(0.25)

    async with httpx.AsyncClient(timeout=120) as client:
        stop = asyncio.Event()
        watcher = asyncio.create_task(watch(client, stop))
        until = time.monotonic() + 12
        await asyncio.gather(*(client_loop(client, i, until) for i in range(clients)))
        deadline = time.monotonic() + 60
        handbook = "The fleet's handbook, read before every answer. " * 40
        while time.monotonic() < deadline and len(seen[-1][1]) > floor:  # until it is back
            await ask(client, f"{handbook} A short question {len(answers)}?", 4)
            await asyncio.sleep(0.2)
        stop.set()
        await watcher
    return seen, answers
