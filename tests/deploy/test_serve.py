"""`prefix-router serve`: a real local Ray, replica actors and the gateway, stopped by Ctrl-C."""

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from deploy.processes import free_port
from replica.api.fleet_token import ENV_FLEET_TOKEN, bearer
from tests.shared import gateway_stats, indexed, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.ray]

TOKEN = "an-operators-fleet-token"


def ray_processes() -> set[int]:
    out = subprocess.run(["pgrep", "-f", "ray/core/src/ray/raylet"], capture_output=True, text=True)
    return {int(pid) for pid in out.stdout.split()}


@contextlib.contextmanager
def serving(
    *flags: str, until: str = "gateway: ", environment: dict[str, str] | None = None
) -> Iterator[tuple[str, subprocess.Popen]]:
    """``prefix-router serve`` with two replicas, yielded once it prints its gateways'
    address (every gateway serves by then), as a user would paste the next command, or
    the line starting with ``until``; then Ctrl-C, which must end it with status 0 and
    leave no Ray instance behind. Its stderr goes to a file: a pipe nobody reads would
    block it once full."""
    before = ray_processes()
    port = free_port()
    serve = [sys.executable, "-m", "prefix_router", "serve", "--port", str(port)]
    command = [*serve, "--replicas", "2", "--replica-speedup", "20", *flags]
    with tempfile.TemporaryFile("w+") as stderr:
        process = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=stderr, text=True, env=environment
        )
        try:
            assert process.stdout is not None
            while not (line := process.stdout.readline()).startswith(until):
                assert line, f"serve ended before it printed {until!r}"
            yield f"http://127.0.0.1:{port}", process
        finally:
            process.send_signal(signal.SIGINT)
            try:
                code = process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                process.kill()
                raise
        stderr.seek(0)
        assert code == 0, stderr.read()
    for _ in range(50):
        if ray_processes() <= before:
            break
        time.sleep(0.2)
    assert ray_processes() <= before, "serve left a Ray instance running"


def test_serve_answers_through_ray_replicas_and_stops_cleanly_on_ctrl_c():
    with serving() as (url, _):  # the newcomer's path: the address, then a request
        backends = httpx.get(url + "/stats").json()["backends"]
        assert sorted(b["replica_id"] for b in backends) == ["replica-0", "replica-1"]
        # the replicas answer only the fleet's token, which serve made and wrote for
        # its user alone (and removes when it stops)
        token_file = Path.home() / ".prefix-router" / f"fleet-token-{url.rsplit(':', 1)[1]}"
        assert token_file.stat().st_mode & 0o777 == 0o600
        token = token_file.read_text().strip()
        replica = backends[0]["url"]
        assert httpx.get(f"{replica}/stats").status_code == 401
        assert httpx.get(f"{replica}/stats", headers=bearer(token)).status_code == 200
        assert httpx.get(f"{replica}/health").status_code == 200
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        system = "Served by Ray actors. " * 50
        replies = [
            client.chat.completions.create(
                model="sim-llama3-8b",
                messages=[{"role": "system", "content": system}, {"role": "user", "content": q}],
                max_tokens=3,
            )
            for q in ("first?", "second?")
        ]
        assert replies[1].usage.prompt_tokens_details.cached_tokens > 200
    assert not token_file.exists()


def test_ctrl_c_while_serve_starts_stops_it_as_cleanly():
    with serving("--gateways", "2", until="2 replicas: "):
        pass  # Ctrl-C as its gateways start: status 0 and no Ray left, all the same


def both_indexed(url: str, timeout_s: float = 10.0) -> None:
    """Until both gateways behind ``url``'s port have indexed every KV event (each
    connection reaches one of them: asked until each has said so)."""
    caught_up: set[int] = set()

    def each() -> bool:
        stats = gateway_stats(url)
        if indexed(stats, TOKEN):
            caught_up.add(stats.pid)
        return len(caught_up) == 2

    wait_for(each, timeout_s, "both gateways' indexes")


def test_serve_with_two_gateways_shares_one_port_between_two_processes():
    # the operator's token, given in the environment (serve makes one without it)
    operators = {**os.environ, ENV_FLEET_TOKEN: TOKEN}
    with serving("--workers", "2", environment=operators) as (url, process):  # --gateways
        pids: set[int] = set()
        for _ in range(40):  # a new connection each time: the kernel spreads them
            stats = httpx.get(url + "/stats").json()
            assert len(stats["backends"]) == 2  # announced: each gateway routes to both
            pids.add(stats["pid"])
        assert len(pids) == 2 and process.pid not in pids  # two gateway actors
        replicas, cached = set(), []
        for question in ("first?", "second?", "third?", "fourth?"):
            reply = httpx.post(
                url + "/v1/completions",
                json={"prompt": "Two gateways, one port. " * 40 + question, "max_tokens": 2},
                timeout=60,
            )
            assert reply.status_code == 200
            replicas.add(reply.headers["x-prefix-router-replica"])
            cached.append(reply.json()["usage"]["prompt_tokens_details"]["cached_tokens"])
            both_indexed(url)  # whichever gateway the next request reaches knows the cache
        assert len(replicas) == 1 and min(cached[1:]) > 200  # every turn found the prefix


def test_a_fleet_of_two_models_and_an_adapter_through_two_gateways():
    fleet = ("--fleet", "llama=2:sql", "--fleet", "qwen=1", "--gateways", "2")
    with serving(*fleet) as (url, _):
        pids = set()
        for _ in range(40):  # a new connection each time: the kernel spreads them
            stats = httpx.get(url + "/stats").json()
            assert len(stats["backends"]) == 3  # announced: each gateway routes to all
            pids.add(stats["pid"])
        assert len(pids) == 2  # both gateways answer
        serves = {
            "llama": {"replica-0", "replica-1"},
            "sql": {"replica-0", "replica-1"},
            "qwen": {"replica-2"},
        }
        models = [m["id"] for m in httpx.get(url + "/v1/models").json()["data"]]
        assert models == ["llama", "qwen", "sql"]
        for turn in range(10):
            for model, replicas in serves.items():
                body = {
                    "model": model,
                    "prompt": f"A {model} fleet. " * 40 + str(turn),
                    "max_tokens": 2,
                }
                reply = httpx.post(url + "/v1/completions", json=body, timeout=60)
                assert reply.status_code == 200, reply.text
                assert reply.headers["x-prefix-router-replica"] in replicas
                assert reply.json()["model"] == model
        missing = httpx.post(url + "/v1/completions", json={"model": "geo", "prompt": "hi"})
        assert missing.status_code == 404


def test_a_disaggregated_fleet_prefills_on_one_replica_and_decodes_on_the_other():
    with serving("--prefill", "1", "--decode", "1", "--policy", "pd_always") as (url, _):
        backends = httpx.get(url + "/stats").json()["backends"]
        roles = {b["replica_id"]: b["role"] for b in backends}
        assert roles == {"replica-0": "prefill", "replica-1": "decode"}
        body = {
            "model": "sim-llama3-8b",
            "messages": [{"role": "user", "content": "Read this. " * 300}],
            "max_tokens": 3,
        }
        answer = httpx.post(url + "/v1/chat/completions", json=body, timeout=60)
        assert answer.status_code == 200, answer.text
        assert answer.headers["x-prefix-router-prefill"] == "replica-0"
        assert answer.headers["x-prefix-router-replica"] == "replica-1"
        # a request the prefill replica refuses is the client's to fix: its 400, no retry
        wrong = httpx.post(url + "/v1/chat/completions", json={**body, "top_p": 2}, timeout=60)
        assert wrong.status_code == 400 and "top_p" in wrong.text
        stats = gateway_stats(url)
        assert stats.paths == {"disaggregated": 2} and stats.retries == 0
