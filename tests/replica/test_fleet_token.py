"""The fleet's credential: a replica answers only requests that carry the fleet's token
(but ``/health``), a gateway and the replicas' peers send it, and a refusal is one log
line."""

import asyncio
import logging
import time

import httpx
import pytest
from fastapi.routing import APIRoute

from deploy.processes import running
from replica.api.fleet_token import ENV_FLEET_TOKEN, FleetTokenGuard, fleet_token
from replica.api.kv_params import pull_params
from replica.server import routes
from tests.shared import gateway_stats, replica_stats, wait_for

pytestmark = pytest.mark.slow

TOKEN = "the-fleets-token"
SYSTEM = "You summarise the documents people send. " * 60  # bytes4: ~600 tokens
DOCUMENT = " ".join(f"clause{i}" for i in range(1500))  # ~2,500 tokens


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    """A prefill and a decode replica that ask the token, and a gateway given it."""
    token_file = tmp_path_factory.mktemp("token") / "fleet-token"
    token_file.write_text(TOKEN + "\n")
    replica = ["replica", "--speedup", "1", "--num-blocks", "4096"]
    roles = (["--role", "prefill"], ["--role", "decode"])
    with running(*(replica + role for role in roles), env={ENV_FLEET_TOKEN: TOKEN}) as replicas:
        backends = [f"--backend={url}" for url in replicas]
        gateway = ["gateway", *backends, "--policy", "pd_conditional"]
        with running([*gateway, "--fleet-token-file", str(token_file)]) as (url,):
            yield url, replicas


def endpoints() -> list[tuple[str, str]]:
    """Every (method, path) the replica serves."""
    return [
        (method, route.path)
        for route in routes.routes
        if isinstance(route, APIRoute)
        for method in sorted(route.methods)
    ]


def test_every_replica_endpoint_but_health_refuses_a_caller_without_the_token(fleet):
    _, (replica, _) = fleet
    assert len(endpoints()) >= 15
    for method, path in endpoints():
        for headers in ({}, {"authorization": "Bearer another-token"}, {"authorization": TOKEN}):
            answer = httpx.request(method, replica + path, headers=headers, json={})
            if path == "/health":
                assert answer.status_code == 200
                continue
            assert answer.status_code == 401, (method, path, headers, answer.text)
            assert answer.headers["www-authenticate"] == "Bearer"
            assert "fleet's token" in answer.json()["error"]["message"]
    carried = {"authorization": f"Bearer {TOKEN}"}
    assert httpx.get(f"{replica}/stats", headers=carried).status_code == 200
    assert httpx.post(f"{replica}/reset", headers=carried).status_code == 200


def test_a_gateway_given_the_token_routes_and_a_replica_pulls_from_its_peer_with_it(fleet):
    url, (prefill, decode) = fleet
    body = {
        "model": "sim-llama3-8b",
        "messages": [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": "Summarise: " + DOCUMENT},
        ],
        "max_tokens": 8,
        "ignore_eos": True,
    }
    answer = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)
    assert answer.status_code == 200, answer.text
    # the gateway's check reached both (its /tokenize and canary carried the token)
    assert {b.routing_mode for b in gateway_stats(url).backends} == {"precise"}
    # a replica's ask to lend (replica/peers.py) carries it too: the pull happens
    carried = {"authorization": f"Bearer {TOKEN}"}
    prompt = {"model": "sim-llama3-8b", "prompt": DOCUMENT, "max_tokens": 2}
    assert httpx.post(f"{prefill}/v1/completions", json=prompt, headers=carried).status_code == 200
    pull = {**prompt, "kv_transfer_params": pull_params(prefill, 1024)}
    answer = httpx.post(f"{decode}/v1/completions", json=pull, headers=carried, timeout=60)
    assert answer.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 1024
    pulled = replica_stats(decode, TOKEN).transfers
    assert pulled.pulls == 1 and pulled.pull_fallbacks == 0


def test_a_gateway_without_the_token_names_it_as_why_it_cannot_check_the_replica(fleet):
    _, (replica, _) = fleet
    with running(["gateway", f"--backend={replica}"]) as (url,):
        wait_for(
            lambda: gateway_stats(url).backends[0].routing_mode != "checking",
            what="the check's verdict",
        )
        # and it stays said: the replica's /kv_events refuses the gateway too, which
        # must not open and close its circuit (each readmission checks it again)
        until = time.monotonic() + 3.0
        while time.monotonic() < until:
            (backend,) = gateway_stats(url).backends
            assert (backend.routing_mode, backend.healthy) == ("approximate", True)
    assert "asks a fleet token the gateway does not carry" in backend.approximate_reason
    assert "--fleet-token-file" in backend.approximate_reason


def test_a_refusal_is_one_log_line_and_a_flood_of_them_a_line_a_second(caplog):
    now = [0.0]
    answered: list[int] = []

    async def app(scope, receive, send):  # what the guard lets through
        answered.append(1)

    guard = FleetTokenGuard(app, TOKEN, clock=lambda: now[0])

    async def call(path: str, headers: list[tuple[bytes, bytes]]) -> int:
        sent: list[dict] = []

        async def send(message):
            sent.append(message)

        scope = {"type": "http", "method": "GET", "path": path, "headers": headers}
        await guard(scope, None, send)
        return sent[0]["status"] if sent else 200

    carried = [(b"authorization", f"Bearer {TOKEN}".encode())]
    with caplog.at_level(logging.WARNING, logger="replica.api.fleet_token"):
        statuses = [asyncio.run(call("/stats", [])) for _ in range(3)]
        now[0] = 0.5
        statuses.append(asyncio.run(call("/kv_events", [])))
        now[0] = 1.5
        statuses.append(asyncio.run(call("/reset", [])))
        statuses += [asyncio.run(call("/health", [])), asyncio.run(call("/stats", carried))]
    assert statuses == [401] * 5 + [200, 200]
    assert len(answered) == 2 and guard.refused == 5
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2, lines
    assert lines[0].startswith("refused GET /stats from ?: no fleet token")
    assert lines[1].startswith("refused GET /reset") and "(3 more since the last line)" in lines[1]


def test_the_token_comes_from_a_file_else_the_environment(tmp_path):
    path = tmp_path / "token"
    path.write_text(" from-a-file \n")
    assert fleet_token(str(path), {ENV_FLEET_TOKEN: "from-env"}) == "from-a-file"
    assert fleet_token("", {ENV_FLEET_TOKEN: "from-env"}) == "from-env"
    assert fleet_token("", {}) == ""
    path.write_text("\n")
    with pytest.raises(ValueError, match="empty"):
        fleet_token(str(path))
