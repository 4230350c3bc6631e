"""A replica dies: the gateway retries elsewhere, stops routing to it, takes it back."""

import json
import os
import signal
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import pytest

from deploy import processes
from deploy.processes import running
from tests.shared import wait_for

pytestmark = pytest.mark.slow

BODY = {"prompt": "A question about caches. " * 20, "max_tokens": 8, "ignore_eos": True}


@contextmanager
def replica_on(port: int) -> Iterator[processes.subprocess.Popen]:
    process = processes.start(["replica", "--speedup", "1"], port)
    try:
        processes.wait_until(f"http://127.0.0.1:{port}", process)
        yield process
    finally:
        processes.stop(process)


def backend(url: str, replica: str) -> dict:
    stats = httpx.get(f"{url}/stats").json()
    return next(b for b in stats["backends"] if b["url"] == replica)


def test_a_dead_replica_is_skipped_at_once_and_taken_back_when_healthy():
    port = processes.free_port()
    victim = f"http://127.0.0.1:{port}"
    # Probes rare enough that requests, not probes, find the dead replica first.
    settings = ["--kv-events-interval-s", "60", "--policy", "round_robin"]
    with (
        running(["replica", "--speedup", "1"]) as (survivor,),
        replica_on(port) as process,
        running(["gateway", f"--backend={survivor}", f"--backend={victim}", *settings]) as (url,),
    ):
        assert backend(url, victim)["healthy"]
        os.kill(process.pid, signal.SIGKILL)
        # Every request succeeds: the ones routed to the dead replica are retried.
        for i in range(20):
            response = httpx.post(f"{url}/v1/completions", json={**BODY, "user": str(i)})
            assert response.status_code == 200, response.text
        assert not backend(url, victim)["healthy"]
        retries = httpx.get(f"{url}/stats").json()["retries"]
        dispatched = backend(url, victim)["dispatched"]
        with replica_on(port):  # the replica comes back on its address
            wait_for(lambda: backend(url, victim)["healthy"], 20)
            for _ in range(4):
                httpx.post(f"{url}/v1/completions", json=BODY)
            assert backend(url, victim)["dispatched"] > dispatched
    assert retries >= 1


def test_a_gateway_whose_every_circuit_is_open_says_it_is_unhealthy():
    """/health is what a load balancer in front of several gateways asks."""
    port = processes.free_port()
    with (
        replica_on(port) as process,
        running(["gateway", f"--backend=http://127.0.0.1:{port}"]) as (url,),
    ):
        assert httpx.get(f"{url}/health").json() == {"status": "ok", "backends": 1, "routable": 1}
        os.kill(process.pid, signal.SIGKILL)
        wait_for(lambda: httpx.get(f"{url}/health").status_code == 503, 20)
        down = httpx.get(f"{url}/health").json()
        assert down == {
            "status": "every backend's circuit is open (1 down)",
            "backends": 1,
            "routable": 0,
        }
        with replica_on(port):
            wait_for(lambda: httpx.get(f"{url}/health").status_code == 200, 20)


def test_a_replica_dying_mid_stream_ends_the_stream_with_an_error_event():
    port = processes.free_port()
    with replica_on(port) as process:
        replica = f"http://127.0.0.1:{port}"
        with running(["gateway", f"--backend={replica}"]) as (url,):
            body = {**BODY, "max_tokens": 400, "stream": True}
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=30) as r:
                events = []
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        events.append(line[6:])
                        if len(events) == 3:
                            os.kill(process.pid, signal.SIGKILL)
            stats = httpx.get(f"{url}/stats").json()
    error = json.loads(events[-2])["error"]
    assert error["code"] == 502 and "mid-stream" in error["message"]
    assert events[-1] == "[DONE]" and len(events) < 400
    assert stats["backends"][0]["outstanding_requests"] == 0  # the load was released
