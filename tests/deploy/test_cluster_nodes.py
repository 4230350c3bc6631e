"""A Ray cluster of three nodes on this machine, each started with `ray start` (its own
raylet and resources): `up` spreads the replicas over them, and a worker node stopped
mid-load costs only the requests in flight on it (a module of its own: `ray stop` ends
every Ray of the machine)."""

import contextlib
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator

import httpx
import psutil
import pytest
import ray

from deploy import cluster
from deploy.processes import free_port
from tests.shared import loopback_env, prefix_router, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.ray]

QUIET = ["--include-dashboard", "false", "--disable-usage-stats"]
#: Each node small. Ray refuses a second node under its single-machine switch
#: (RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0, which keeps it on 127.0.0.1), so these nodes run
#: without it and take the machine's address (even told --node-ip-address 127.0.0.1);
#: the fleet's own servers are put on loopback with `up --host`.
SMALL = ["--num-cpus", "1", "--object-store-memory", str(80 * 2**20)]


def ray_cli(*args: str) -> subprocess.CompletedProcess:
    ray_command = os.path.join(os.path.dirname(sys.executable), "ray")
    # a worker names the head, so it is told to send Ray's token (auto would read it)
    env = loopback_env(RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="1", RAY_AUTH_MODE="token")
    return subprocess.run(
        [ray_command, *args], capture_output=True, text=True, env=env, timeout=120
    )


@pytest.fixture
def three_nodes() -> Iterator[str]:
    """A head and two worker nodes, each its own `ray start`; the head's address; `ray
    stop` however the test ends."""
    assert ray_cli("get-auth-token", "--generate").returncode == 0
    address = f"127.0.0.1:{free_port()}"
    try:
        port = address.split(":")[1]
        head = ray_cli("start", "--head", "--port", port, *SMALL, *QUIET)
        assert head.returncode == 0, head.stderr
        for _ in range(2):
            joined = ["--address", address, *SMALL, "--disable-usage-stats"]
            worker = ray_cli("start", *joined)
            assert worker.returncode == 0, worker.stderr
        yield address
    finally:
        ray_cli("stop", "--force")


def replica_nodes() -> dict[str, str]:
    """Each answering replica actor's node, by name (asked of the actors: Ray's state API needs the
    dashboard)."""
    nodes = {}
    for name in ray.util.list_named_actors():
        if name.startswith("replica-"):
            # one lost with its node, or being placed again, does not answer
            with contextlib.suppress(ray.exceptions.RayError, TimeoutError):
                nodes[name] = ray.get(ray.get_actor(name).node_id.remote(), timeout=10)
    return nodes


def backend_figures(gateway: str) -> dict[str, dict]:
    """The gateway's figures of each backend, by URL."""
    return {b["url"]: b for b in httpx.get(f"{gateway}/stats").json()["backends"]}


def stop_node(node_id: str) -> None:
    """Kill a node's raylet and every process under it, as a machine that is lost."""
    named = f"--node_id={node_id}"
    (raylet,) = [p for p in psutil.process_iter(["cmdline"]) if named in (p.info["cmdline"] or [])]
    for process in [*raylet.children(recursive=True), raylet]:
        process.send_signal(signal.SIGKILL)


def test_up_spreads_replicas_over_three_nodes_and_a_node_lost_mid_load_fails_only_its_requests(
    three_nodes,
):
    port = free_port()
    gateway = f"http://127.0.0.1:{port}"
    up = prefix_router(
        "up", "--address", three_nodes, "--replicas", "3", "--replica-speedup", "20",
        # the nodes are this machine, whose address Ray gives them: its clients use loopback
        "--host", "127.0.0.1", "--port", str(port),
    )  # fmt: skip
    assert up.returncode == 0, up.stderr
    cluster.connect(three_nodes)
    try:
        placed = replica_nodes()
        assert len(set(placed.values())) == 3, placed  # one replica per node
        gateway_node = ray.get(ray.get_actor("gateway-0").node_id.remote(), timeout=30)
        lost_name, lost_node = next((n, node) for n, node in placed.items() if node != gateway_node)

        answered, failed, stop = [], [], threading.Event()

        def clients(worker: int) -> None:
            with httpx.Client(timeout=60) as client:
                turn = 0
                while not stop.is_set():
                    body = {"prompt": f"client {worker} turn {turn} " * 20, "max_tokens": 16}
                    try:
                        ok = client.post(f"{gateway}/v1/completions", json=body).status_code
                    except httpx.HTTPError:
                        ok = 0
                    (answered if ok == 200 else failed).append(ok)
                    turn += 1

        threads = [threading.Thread(target=clients, args=(i,)) for i in range(6)]
        for thread in threads:
            thread.start()
        wait_for(
            lambda: len(answered) >= 30,
            timeout_s=60,
            what=f"load on the three nodes (failed: {failed[:5]}, {up.stdout[-500:]})",
        )
        lost_url = ray.get(ray.get_actor(lost_name).card.remote(), timeout=30).url
        stop_node(lost_node)
        in_flight = backend_figures(gateway)[lost_url]["outstanding_requests"]
        before = len(answered)
        # the gateway keeps serving on the two nodes left...
        wait_for(lambda: len(answered) >= before + 60, timeout_s=60, what="serving after")
        # ...and Ray places the lost node's replica again, on a node that has room
        wait_for(
            lambda: lost_name in (nodes := replica_nodes()) and nodes[lost_name] != lost_node,
            timeout_s=90,
            what="the lost replica placed again",
        )
        stop.set()
        for thread in threads:
            thread.join()
        # only requests in flight on the lost node may fail (the gateway retries those it
        # can: an answer not yet begun)
        assert len(failed) <= in_flight, (failed, in_flight)

        def healthy() -> int:
            return sum(b["healthy"] for b in backend_figures(gateway).values())

        wait_for(lambda: healthy() == 3, timeout_s=60, what="three replicas behind the gateway")
    finally:
        ray.shutdown()
