"""Real servers for tests: ``prefix-router`` subprocesses on free loopback ports."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_healthy(url: str, process: subprocess.Popen, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{url} exited with {process.returncode}: {process.stderr.read()}")  # type: ignore[union-attr]
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/health", timeout=1.0).status_code == 200:
                return
        time.sleep(0.1)
    raise TimeoutError(f"{url} did not become healthy in {timeout_s} s")


@contextlib.contextmanager
def running(*commands: list[str]) -> Iterator[list[str]]:
    """Start ``prefix-router`` subcommands (each given its --port), yield their URLs,
    and stop every one of them however the test ends."""
    processes: list[subprocess.Popen] = []
    urls = []
    try:
        for command in commands:
            port = free_port()
            process = subprocess.Popen(
                [sys.executable, "-m", "deploy.cli", *command, "--port", str(port)],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                text=True,
            )
            processes.append(process)
            url = f"http://127.0.0.1:{port}"
            wait_healthy(url, process)
            urls.append(url)
        yield urls
    finally:
        for process in processes:
            process.terminate()
        for process in processes:
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
