"""``prefix-router`` servers as subprocesses on free loopback ports (bench and tests)."""

from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from typing import IO

import httpx

#: Ports handed to a server that binds them later come from below the kernel's ephemeral
#: range (Linux's default is 32768-60999) and above Ray's worker ports (10002-19999).
#: A port drawn from the ephemeral range is free only until the next socket bound to
#: port 0 or the next outgoing connection, which a replica or a Ray worker can make
#: before the server binds it (a gateway found its port taken so, once in CI).
HANDED_OUT_PORTS = range(20000, 32768)
EPHEMERAL_RANGE_FILE = "/proc/sys/net/ipv4/ip_local_port_range"
#: Ports this process handed out: never twice, for a server may bind its port long
#: after it was chosen (a vLLM server binds its KV events' ports some 40 s later), and
#: two draws free at the same moment collided so once in CI.
_given_out: set[int] = set()


def free_port(host: str = "127.0.0.1", rng: random.Random | None = None) -> int:
    """A port free on ``host`` now, that no port-0 bind or outgoing connection takes,
    and that this process has not handed out before."""
    ports = _handed_out_ports()
    rng = rng or random.Random()
    for _ in range(200):
        port = rng.choice(ports)
        if port in _given_out:
            continue
        with socket.socket() as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
            _given_out.add(port)
            return port
    raise RuntimeError(f"no free port on {host} in {ports.start}-{ports.stop - 1}")


def _handed_out_ports() -> range:
    """:data:`HANDED_OUT_PORTS`, cut below this machine's ephemeral range where that
    leaves enough of it."""
    try:
        with open(EPHEMERAL_RANGE_FILE) as lines:
            ephemeral_low = int(lines.read().split()[0])
    except (OSError, ValueError, IndexError):
        return HANDED_OUT_PORTS
    below = range(HANDED_OUT_PORTS.start, min(HANDED_OUT_PORTS.stop, ephemeral_low))
    return below if len(below) >= 1000 else HANDED_OUT_PORTS


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
    command: list[str],
    port: int,
    stderr: int | IO[str] = subprocess.PIPE,
    env: Mapping[str, str] | None = None,
) -> subprocess.Popen:
    """``python -m prefix_router COMMAND --port PORT`` in its own process group, with
    ``env`` added to this process's environment."""
    return subprocess.Popen(
        [sys.executable, "-m", "prefix_router", *command, "--port", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=stderr,
        env={**os.environ, **env} if env else None,
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
def running(*commands: list[str], env: Mapping[str, str] | None = None) -> Iterator[list[str]]:
    """Start ``prefix-router`` subcommands (each given its --port, ``env`` added to
    their environment), yield their URLs, and stop every one of them however the
    caller ends."""
    processes: list[subprocess.Popen] = []
    urls = []
    try:
        for command in commands:
            port = free_port()
            process = start(command, port, env=env)
            processes.append(process)
            url = f"http://127.0.0.1:{port}"
            wait_until(url, process)
            urls.append(url)
        yield urls
    finally:
        for process in processes:
            stop(process)
