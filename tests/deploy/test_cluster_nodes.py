"""A Ray cluster of three nodes on this machine, each started with `ray start` (its own
raylet and resources): `up` spreads the replicas and gateways over them, and a worker
node stopped mid-load costs only the requests in flight on it (a module of its own:
`ray stop` ends every Ray of the machine)."""

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
from replica.api import stats as stats_codec
from router.stats import BackendStats, GatewayStats
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


def gateway_actor(index: int) -> ray.actor.ActorHandle:
    return ray.get_actor(f"gateway-{index}")


def gateways_figures() -> list[BackendStats]:
    """Each gateway's figures of each of its backends (asked of the actors: behind one
    port, a request reaches either gateway)."""
    raw = ray.get([gateway_actor(i).stats.remote() for i in (0, 1)], timeout=30)
    return [b for stats in raw for b in stats_codec.decode(GatewayStats, stats).backends]


def stop_node(node_id: str) -> None:
    """Kill a node's raylet and every process under it, as a machine that is lost."""
    named = f"--node_id={node_id}"
    (raylet,) = [p for p in psutil.process_iter(["cmdline"]) if named in (p.info["cmdline"] or [])]
    for process in [*raylet.children(recursive=True), raylet]:
        process.send_signal(signal.SIGKILL)


def test_up_spreads_over_three_nodes_and_a_node_lost_mid_load_fails_only_its_requests(
    three_nodes,
):
    port = free_port()
    gateway = f"http://127.0.0.1:{port}"
    fleet = ["up", "--address", three_nodes, "--replicas", "3", "--replica-speedup", "20"]
    # the nodes are this machine, whose address Ray gives them: its clients use loopback
    fleet += ["--host", "127.0.0.1", "--port", str(port)]
    refused = prefix_router(*fleet, "--gateways", "4")
    assert "one gateway per node, and the cluster has 3" in refused.stderr
    up = prefix_router(*fleet, "--gateways", "2")
    assert up.returncode == 0, up.stderr
    cluster.connect(three_nodes)
    try:
        gateways, replicas = cluster.status()
        assert len({row.node_id for row in replicas}) == 3, replicas  # a replica on each
        assert len({row.node_id for row in gateways}) == 2, gateways  # from the head on
        assert all(row.healthy for row in [*gateways, *replicas])
        # one fleet secret for both gateways (tenants' salts keyed alike), made by up
        secrets = {ray.get(gateway_actor(i).fleet_credentials.remote()).secret for i in (0, 1)}
        assert len(secrets) == 1 and len(secrets.pop()) == 64
        placed = replica_nodes()
        lost_name, lost_node = next(
            (name, node)
            for name, node in placed.items()
            if node not in {row.node_id for row in gateways}
        )

        answered, failed, stop = [], [], threading.Event()

        def clients(worker: int) -> None:
            # a connection a request: the gateways share one port (the kernel spreads new
            # connections), and 6 kept-alive ones all landed on one gateway once in CI
            # (2 x 2**-6 of the time), which then served nothing
            fresh = httpx.Limits(max_keepalive_connections=0)
            with httpx.Client(timeout=60, limits=fresh) as client:
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
        on_lost = [b for b in gateways_figures() if b.url == lost_url]
        in_flight = sum(b.outstanding_requests for b in on_lost)
        sent_before = sum(b.dispatched for b in on_lost)
        stop_node(lost_node)
        before = len(answered)
        # the gateway keeps serving on the two nodes left...
        wait_for(lambda: len(answered) >= before + 60, timeout_s=60, what="serving after")
        # the requests on the lost node: those in flight when it was sampled, and those
        # sent to it since (between the sample and the loss, or before the gateways saw
        # it gone), as far as the gateways still show it
        sent_after = sum(b.dispatched for b in gateways_figures() if b.url == lost_url)
        in_flight += max(0, sent_after - sent_before)
        # ...and Ray places the lost node's replica again, on a node that has room
        wait_for(
            lambda: lost_name in (nodes := replica_nodes()) and nodes[lost_name] != lost_node,
            timeout_s=90,
            what="the lost replica placed again",
        )
        stop.set()
        for thread in threads:
            thread.join()
        # only requests in flight on the lost node may fail (a gateway retries those it
        # can: an answer not yet begun)
        assert len(failed) <= in_flight, (failed, in_flight)
        placed_gateways = {row.name: row.node_id for row in gateways}
        gateways, _ = cluster.status()
        # no gateway lost with another node (once seen under CI: gateway-1 gone, undiagnosed)
        alive = cluster.nodes_head_first()
        assert len(gateways) == 2, (placed_gateways, lost_node, alive, gateways)
        assert all(row.requests for row in gateways), gateways  # both served, one port

        def healthy() -> int:
            return sum(b.healthy for b in gateways_figures())

        wait_for(lambda: healthy() == 6, timeout_s=60, what="3 replicas behind each gateway")
    finally:
        ray.shutdown()
