"""SGLang's router (the real ``sglang-router`` binary) in front of our replicas.

The incumbent a user would deploy instead of ours: the bench runs it as one more row
(label :data:`LABEL`) on the very replicas our gateway fronts, and the gateway
benchmark measures its throughput. It runs as its own process, started on free
loopback ports and stopped however the caller ends.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx

from deploy.processes import free_port

#: The bench's label for a row routed by SGLang's router.
LABEL = "sglang_router"
#: Our replay's re-implementation of that router's algorithm: the row's prediction.
REPLAYED_AS = "sglang_cache_aware"
#: SGLang's router fetches a tokenizer for the model it finds; keep that on loopback,
#: where nothing answers, so it routes by text (this machine has no other network).
OFFLINE_ENV = {"HF_ENDPOINT": "http://127.0.0.1:9", "HF_HUB_OFFLINE": "1"}


@dataclass(frozen=True)
class SGLangRouterConfig:
    """How to run it: its policy (its own names) and how long it may take to start."""

    policy: str = "cache_aware"
    startup_timeout_s: float = 60.0
    stop_timeout_s: float = 30.0
    log_level: str = "error"

    def __post_init__(self) -> None:
        if self.startup_timeout_s <= 0 or self.stop_timeout_s <= 0:
            raise ValueError("startup_timeout_s and stop_timeout_s must be positive")


def command(workers: Sequence[str], port: int, config: SGLangRouterConfig) -> list[str]:
    # Its Prometheus exporter listens on 29000 unless told: a free port, so that two
    # routers (or another user's) never collide.
    return [
        sys.executable,
        "-m",
        "sglang_router.launch_router",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--worker-urls",
        *workers,
        "--policy",
        config.policy,
        "--log-level",
        config.log_level,
        "--prometheus-port",
        str(free_port()),
    ]


@contextlib.contextmanager
def sglang_router(
    workers: Sequence[str], config: SGLangRouterConfig | None = None, log: Path | None = None
) -> Iterator[str]:
    """Start SGLang's router over ``workers``, yield its URL once it sees every worker
    healthy, and stop it on the way out, failures included. Its output goes to ``log``
    (a file, not a pipe: a pipe nobody reads would stall it once full)."""
    config = config or SGLangRouterConfig()
    port = free_port()
    with contextlib.ExitStack() as stack:
        if log is None:
            log = Path(stack.enter_context(tempfile.TemporaryDirectory())) / "sglang_router.log"
        output = stack.enter_context(open(log, "w"))
        process = subprocess.Popen(
            command(workers, port, config),
            env={**os.environ, **OFFLINE_ENV},
            stdout=output,
            stderr=output,
            start_new_session=True,  # a Ctrl-C meant for the bench is ours to pass on
        )
        url = f"http://127.0.0.1:{port}"
        try:
            wait_ready(url, process, len(workers), config.startup_timeout_s, log)
            yield url
        finally:
            stop(process, config.stop_timeout_s)


def wait_ready(
    url: str, process: subprocess.Popen, workers: int, timeout_s: float, log: Path
) -> None:
    """Until its ``/readiness`` counts every worker healthy; it sends no request to a
    worker, so the caches stay as they were."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            error = log.read_text(errors="replace")[-2000:]
            raise RuntimeError(f"SGLang's router exited with {process.returncode}: {error}")
        with contextlib.suppress(httpx.HTTPError, ValueError):
            reply = httpx.get(url + "/readiness", timeout=1.0)
            if reply.status_code == 200 and reply.json().get("healthy_workers") == workers:
                return
        time.sleep(0.2)
    raise TimeoutError(f"SGLang's router at {url} was not ready in {timeout_s} s")


def stop(process: subprocess.Popen, timeout_s: float) -> None:
    """SIGTERM, then SIGKILL if it lingers."""
    if process.poll() is None:
        process.terminate()
    try:
        process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
