"""SGLang's router (the real ``sglang-router`` binary) in front of our replicas.

The incumbent a user would deploy instead of ours: the bench runs it as one more row
(label :data:`LABEL`) on the very replicas our gateway fronts, and the gateway
benchmark measures its throughput. It runs as its own process
(loadtest/router_process.py).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx

from deploy.processes import free_port
from loadtest.router_process import router_process

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


def command(
    workers: Sequence[str], port: int, config: SGLangRouterConfig, api_key: str = ""
) -> list[str]:
    # Its Prometheus exporter listens on 29000 unless told: a free port, so that two
    # routers (or another user's) never collide. ``api_key``: what it sends its workers
    # as a bearer token, and asks of its own clients (SGLang's router has one key).
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
        *(["--api-key", api_key] if api_key else []),
    ]


@contextlib.contextmanager
def sglang_router(
    workers: Sequence[str],
    config: SGLangRouterConfig | None = None,
    log: Path | None = None,
    api_key: str = "",
) -> Iterator[str]:
    """Start SGLang's router over ``workers`` (that ask ``api_key`` of callers), yield
    its URL once its ``/readiness`` counts every worker healthy (it sends no request to
    a worker, so the caches stay as they were), and stop it on the way out, failures
    included."""
    config = config or SGLangRouterConfig()
    port = free_port()

    def ready(reply: httpx.Response) -> bool:
        return reply.status_code == 200 and reply.json().get("healthy_workers") == len(workers)

    with router_process(
        "SGLang's router",
        command(workers, port, config, api_key),
        f"http://127.0.0.1:{port}",
        ready,
        "/readiness",
        config.startup_timeout_s,
        config.stop_timeout_s,
        log,
        OFFLINE_ENV,
    ) as url:
        yield url
