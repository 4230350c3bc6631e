"""``prefix-router`` servers as subprocesses on free loopback ports (bench and tests)."""

from __future__ import annotations

import contextlib
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from typing import IO

import httpx


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def free_ports(count: int, attempts: int = 100) -> int:
    """The first of ``count`` consecutive free loopback ports."""
    for _ in range(attempts):
        base = free_port()
        with contextlib.ExitStack() as held:
            try:
                for port in range(base, base + count):
                    sock = held.enter_context(socket.socket())
                    sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return base
    raise RuntimeError(f"no {count} consecutive free ports")


def wait_until(
    url: str,
    process: subprocess.Popen,
    ready: Callable[[httpx.Response], bool] = lambda r: r.status_code == 200,
    path: str = "/health",
    timeout_s: float = 60.0,
) -> None:
    """Wait until ``GET url+path`` satisfies ``ready``; fail at once if the process dies."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            output = process.stderr.read() if process.stderr else ""
            raise RuntimeError(f"{url} exited with {process.returncode}: {output}")
        with contextlib.suppress(httpx.HTTPError):
            if ready(httpx.get(url + path, timeout=1.0)):
                return
        time.sleep(0.1)
    raise TimeoutError(f"{url} was not ready in {timeout_s} s")


def start(
    command: list[str], port: int, stderr: int | IO[str] = subprocess.PIPE
) -> subprocess.Popen:
    """``python -m deploy.cli COMMAND --port PORT`` in its own process group."""
    return subprocess.Popen(
        [sys.executable, "-m", "deploy.cli", *command, "--port", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=stderr,
        text=True,
        start_new_session=True,  # Ctrl-C in a terminal reaches us, and we stop it in order
    )


def stop(process: subprocess.Popen, timeout_s: float = 30.0) -> None:
    """SIGINT first (``serve`` then stops its gateway, actors and Ray), then kill."""
    if process.poll() is None:
        process.send_signal(signal.SIGINT)
    try:
        process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


@contextlib.contextmanager
def running(*commands: list[str]) -> Iterator[list[str]]:
    """Start ``prefix-router`` subcommands (each given its --port), yield their URLs,
    and stop every one of them however the caller ends."""
    processes: list[subprocess.Popen] = []
    urls = []
    try:
        for command in commands:
            port = free_port()
            process = start(command, port)
            processes.append(process)
            url = f"http://127.0.0.1:{port}"
            wait_until(url, process)
            urls.append(url)
        yield urls
    finally:
        for process in processes:
            stop(process)
