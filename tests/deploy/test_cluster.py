"""Deployment onto a real `ray start --head` cluster (several nodes: test_cluster_nodes.py)."""

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import ray

from deploy.names import NAMESPACE
from deploy.processes import free_port
from replica.api.fleet_token import bearer
from tests.deploy.test_autoscale import burst_then_trickle
from tests.loadtest.test_bench import TINY, check_report
from tests.shared import (
    VLLM_ARGS,
    gateway_stats,
    leaves_no_vllm_behind,
    loopback_env,
    prefix_router,
    wait_for,
    wait_until_checked,
)

pytestmark = [pytest.mark.slow, pytest.mark.ray]


def ray_cli(*args: str) -> subprocess.CompletedProcess:
    ray = os.path.join(os.path.dirname(sys.executable), "ray")
    return subprocess.run(
        [ray, *args], capture_output=True, text=True, env=loopback_env(), timeout=120, check=False
    )


@pytest.fixture(scope="module")
def head() -> Iterator[str]:
    """`ray start --head` for this module (token authentication on, Ray's default);
    its address; `ray stop` however the tests end."""
    # Ray turns authentication on for `ray start` only where a token exists (a local
    # ray.init() writes one): make one as Ray's docs say, so the module runs alone too.
    assert ray_cli("get-auth-token", "--generate").returncode == 0
    port = free_port()
    quiet = ["--include-dashboard", "false", "--disable-usage-stats"]
    started = ray_cli("start", "--head", "--port", str(port), "--num-cpus", "2", *quiet)
    assert started.returncode == 0, started.stderr
    try:
        yield f"127.0.0.1:{port}"
    finally:
        ray_cli("stop", "--force")


def up_two_replicas() -> tuple[int, str, subprocess.CompletedProcess]:
    """`prefix-router up` with 2 replicas; the gateway's port and URL, and the output."""
    port = free_port()
    done = prefix_router(
        "up", "--address", "auto", "--replicas", "2", "--port", str(port), "--replica-speedup", "20"
    )
    assert done.returncode == 0, done.stderr
    return port, f"http://127.0.0.1:{port}", done


def test_up_status_scale_and_down_on_a_ray_start_cluster(head):
    port, gateway, done = up_two_replicas()
    assert f"gateway: {gateway}/v1" in done.stdout
    try:
        client = openai.OpenAI(base_url=gateway + "/v1", api_key="unused", max_retries=3)
        for question in ("one?", "two?"):
            reply = client.chat.completions.create(
                model="sim-llama3-8b",
                messages=[
                    {"role": "system", "content": "Cluster prompt. " * 60},
                    {"role": "user", "content": question},
                ],
                max_tokens=3,
            )
        assert reply.usage.prompt_tokens_details.cached_tokens > 200
        # The head named as an operator on another node would: Ray's token is used.
        status = prefix_router("status", "--address", head)
        assert status.returncode == 0, status.stderr
        lines = [line for line in status.stdout.splitlines() if line.startswith("replica-")]
        assert len(lines) == 2 and all(" ok " in line for line in lines)
        assert all(line.endswith("precise") for line in lines)  # how gateway-0 routes them
        (front,) = [line for line in status.stdout.splitlines() if line.startswith("gateway-0")]
        assert gateway in front and " ok " in front and front.split()[-2] == "2"  # requests
        first_url = lines[0].split()[2]
        # the replicas answer only the fleet's token, which up made and wrote for its user
        assert "fleet-token-up" in done.stdout
        token = (Path.home() / ".prefix-router" / "fleet-token-up").read_text().strip()
        assert httpx.get(f"{first_url}/stats").status_code == 401
        assert httpx.get(f"{first_url}/stats", headers=bearer(token)).status_code == 200

        bigger = prefix_router("up", "--address", "auto", "--replicas", "3", "--port", str(port))
        assert bigger.returncode == 0, bigger.stderr
        assert first_url in bigger.stdout  # the replicas that stay keep their server (and cache)
        # the new replica asks the running fleet's token, as the others do
        status = prefix_router("status", "--address", "auto").stdout.splitlines()
        assert sum(" ok " in line for line in status if line.startswith("replica-")) == 3
        smaller = prefix_router("up", "--address", "auto", "--replicas", "1", "--port", str(port))
        assert smaller.returncode == 0 and "1 replicas" in smaller.stdout
        for _ in range(50):
            backends = httpx.get(gateway + "/stats").json()["backends"]
            if [b["replica_id"] for b in backends] == ["replica-0"]:
                break
            time.sleep(0.1)
        assert [b["replica_id"] for b in backends] == ["replica-0"]
    finally:
        down = prefix_router("down", "--address", "auto")
    assert down.returncode == 0 and "removed 2 actors" in down.stdout
    after = prefix_router("status", "--address", "auto")
    assert "gateway: not running" in after.stdout
    assert not [line for line in after.stdout.splitlines() if line.startswith("replica-")]


@pytest.mark.vllm
def test_up_grows_from_two_replicas_to_four_under_a_burst_and_back_failing_nothing(head):
    port = free_port()
    bounds = ["--min-replicas", "2", "--max-replicas", "4", "--target-ongoing-requests", "4"]
    delays = ["--upscale-delay-s", "1", "--downscale-delay-s", "3", "--interval-s", "0.5"]
    fleet = ["--replicas", "2", "--replica-speedup", "0.2", *bounds, *delays]
    done = prefix_router("up", "--address", "auto", "--port", str(port), *fleet)
    assert done.returncode == 0, done.stderr
    assert "autoscaling: 2 to 4 replicas (scale-in by cache)" in done.stdout
    try:
        seen, answers = asyncio.run(burst_then_trickle(f"http://127.0.0.1:{port}", 16, 2))
    finally:
        removed = prefix_router("down", "--address", "auto")
    assert removed.returncode == 0, removed.stderr
    assert not [answer for answer in answers if answer[0] != 200]
    sizes = [len(replicas) for _, replicas in seen]
    assert sizes[0] == 2 and max(sizes) == 4 and sizes[-1] == 2, sizes
    assert len({replica for _, replica in answers}) == 4  # the new ones served
    assert any(any(replicas.values()) for _, replicas in seen)  # they drained, then went


def test_a_vllm_replica_on_a_ray_start_cluster_up_status_and_down(head, tiny_model):
    """A CPU server takes every core of its node: this one-node cluster holds one, which
    `up` places, the gateway routes precisely, and `down` stops with its files."""
    engine = ["--engine", "vllm", "--model", str(tiny_model)]
    with leaves_no_vllm_behind():  # the server stops with its actor, its files removed
        refused = prefix_router("up", "--address", "auto", *engine, "--replicas", "2")
        assert refused.returncode == 2
        refusal = "one vLLM replica per node (it takes every core), and the cluster has 1"
        assert refusal in refused.stderr
        assert "replica-" not in prefix_router("status", "--address", "auto").stdout

        port = free_port()
        one = [*engine, "--engine-arg", " ".join(VLLM_ARGS), "--replicas", "1"]
        try:
            done = prefix_router("up", "--address", "auto", *one, "--port", str(port))
            assert done.returncode == 0, done.stderr
            gateway = f"http://127.0.0.1:{port}"
            stats = wait_until_checked(gateway, 1)
            backends = [(b.engine, b.routing_mode, b.block_size) for b in stats.backends]
            assert backends == [("vllm", "precise", 32)]
            client = openai.OpenAI(base_url=gateway + "/v1", api_key="unused", max_retries=3)
            reply = client.completions.create(
                model=str(tiny_model), prompt="Hello, fleet", max_tokens=4
            )
            assert reply.usage.completion_tokens == 4
            status = prefix_router("status", "--address", "auto").stdout.splitlines()
            (line,) = [x for x in status if x.startswith("replica-0")]
            assert " ok " in line and line.endswith("precise")
        finally:
            down = prefix_router("down", "--address", "auto")
        assert down.returncode == 0 and "removed 2 actors" in down.stdout


def test_up_on_a_busy_port_names_it_and_leaves_no_gateway_behind(head):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        try:
            done = prefix_router("up", "--address", "auto", "--replicas", "1", "--port", str(port))
            assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
            assert f"error: port {port} on 127.0.0.1 is in use" in done.stderr
            status = prefix_router("status", "--address", "auto")
            assert "gateway: not running" in status.stdout
        finally:
            prefix_router("down", "--address", "auto")


def test_a_wrong_authentication_token_is_named_as_the_problem(head):
    # Ray's own retries cut (20 by default, a second each): refused every time anyway
    wrong = loopback_env(RAY_AUTH_TOKEN="0" * 32, RAY_NUM_REDIS_GET_RETRIES="2")
    done = prefix_router("status", "--address", head, env=wrong, timeout_s=120)
    assert done.returncode == 2
    assert f"the Ray cluster at {head} refused this machine's authentication token" in done.stderr


def test_ray_restarts_a_dead_replica_and_the_gateway_readmits_it_and_a_killed_gateway(head):
    _, gateway, _ = up_two_replicas()
    try:
        ray.init(address="auto", namespace=NAMESPACE, log_to_driver=False)
        before = {
            b["replica_id"]: b["url"] for b in httpx.get(gateway + "/stats").json()["backends"]
        }
        ray.kill(ray.get_actor("replica-1"), no_restart=False)  # as if its process died
        for _ in range(300):
            after = {
                b["replica_id"]: b["url"] for b in httpx.get(gateway + "/stats").json()["backends"]
            }
            if after.get("replica-1") not in (None, before["replica-1"]):
                break
            time.sleep(0.1)
        assert after["replica-0"] == before["replica-0"]
        assert after["replica-1"] != before["replica-1"]  # restarted, re-admitted on a new port
        assert httpx.get(after["replica-1"] + "/health").status_code == 200

        # The gateway's process killed outright: Ray restarts its actor, which takes the
        # port again as it starts and learns both replicas before it serves.
        killed = gateway_stats(gateway).pid
        os.kill(killed, signal.SIGKILL)

        def back() -> bool:
            try:
                stats = gateway_stats(gateway)
            except httpx.HTTPError:
                return False
            return stats.pid != killed and sum(b.healthy for b in stats.backends) == 2

        wait_for(back, 60, "the killed gateway restarted by Ray, serving on its port")
        body = {"prompt": "back again", "max_tokens": 2}
        answer = httpx.post(gateway + "/v1/completions", json=body, timeout=30)
        assert answer.status_code == 200
    finally:
        ray.shutdown()
        prefix_router("down", "--address", "auto")


def test_bench_finds_the_cluster_gateway_and_compares_policies_on_it(head, tmp_path):
    _, gateway, _ = up_two_replicas()
    try:
        policies = ["--policies", "round_robin,cache_aware"]
        done = prefix_router("bench", "--address", "auto", "--out", str(tmp_path), *TINY, *policies)
    finally:
        prefix_router("down", "--address", "auto")
    assert done.returncode == 0, done.stderr[-3000:]
    check_report(tmp_path, ["round_robin", "cache_aware"])
    meta = json.loads((tmp_path / "report.json").read_text())["meta"]
    assert meta["target"] == f"Ray cluster auto, gateway {gateway}"
