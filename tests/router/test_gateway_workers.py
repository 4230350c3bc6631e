"""``gateway --workers N``: N gateway processes on one port, each routing, stopped together."""

import os
import signal
import socket
import subprocess
import sys

import httpx
import psutil
import pytest

from deploy import processes
from deploy.processes import free_port, running
from tests.shared import gateway_stats, wait_for

pytestmark = pytest.mark.slow


def test_two_workers_share_the_port_route_and_stop_together():
    with running(["replica", "--speedup", "100"]) as (replica,):
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        gateway = processes.start(["gateway", f"--backend={replica}", "--workers", "2"], port)
        workers: set[int] = set()
        try:
            processes.wait_until(url, gateway)

            def both_answered() -> bool:  # a new connection each time: the kernel spreads them
                workers.add(gateway_stats(url).pid)
                return len(workers) == 2

            wait_for(both_answered, 30, "both workers answering on the port")
            assert workers <= {child.pid for child in psutil.Process(gateway.pid).children()}
            body = {"prompt": "Hello, workers. " * 40, "max_tokens": 2}
            for _ in range(10):
                assert httpx.post(f"{url}/v1/completions", json=body, timeout=30).status_code == 200
        finally:
            processes.stop(gateway)  # SIGINT to the parent alone, as a supervisor sends it
        assert gateway.returncode == 0
        wait_for(lambda: not any(psutil.pid_exists(pid) for pid in workers), 30, "workers gone")


def test_a_worker_that_dies_stops_the_others_and_the_command_fails():
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    gateway = processes.start(["gateway", "--workers", "2"], port)
    try:
        wait_for(lambda: len(workers_of(gateway)) == 2, 60, "two workers")
        first, second = workers_of(gateway)
        wait_for(lambda: listening(url), 60, "the port served")
        os.kill(first, signal.SIGKILL)  # as the kernel's OOM killer would
        assert gateway.wait(timeout=60) == 1
        wait_for(lambda: not psutil.pid_exists(second), 30, "the other worker stopped")
    finally:
        processes.stop(gateway)


def workers_of(process: subprocess.Popen) -> list[int]:
    """The command's gateway processes (spawned with multiprocessing's resource tracker
    beside them, which serves nothing)."""
    children = psutil.Process(process.pid).children()
    return [c.pid for c in children if "resource_tracker" not in " ".join(c.cmdline())]


def listening(url: str) -> bool:
    try:
        httpx.get(f"{url}/health", timeout=2)
    except httpx.HTTPError:
        return False
    return True


def test_a_busy_port_is_said_once_and_no_worker_is_left():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        command = [sys.executable, "-m", "prefix_router", "gateway", "--workers", "2"]
        done = subprocess.run(
            [*command, "--port", str(port)], capture_output=True, text=True, timeout=60
        )
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert f"port {port} on 127.0.0.1 is in use" in done.stderr
