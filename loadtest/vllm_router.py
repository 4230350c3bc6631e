"""vLLM's router (PyPI ``vllm-router``, Rust) in front of our replicas: in its P/D mode,
or in its regular mode over one pool (``regular=True``: the gateway benchmark's row).

Our replicas speak vLLM's ``kv_transfer_params`` protocol (replica/api/kv_params.py),
so the router a vLLM user would deploy for a disaggregated fleet fronts them as it
fronts vLLM servers: ``--vllm-pd-disaggregation`` with the prefill replicas and the
decode ones. For each request it sends the prefill (one token, ``do_remote_decode``),
waits for its answer, then sends the decode with the returned parameters. The bench
runs it as one more row (label :data:`LABEL`) on the very replicas our gateway fronts.
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

#: The bench's label for a row routed by vLLM's router in P/D mode.
LABEL = "vllm_router_pd"


@dataclass(frozen=True)
class VLLMRouterConfig:
    """How to run it: its policy for both pools (its own names: ``cache_aware``, its
    default, matches prefixes in an approximate tree of what it routed)."""

    policy: str = "cache_aware"
    startup_timeout_s: float = 60.0
    stop_timeout_s: float = 30.0
    log_level: str = "warning"


def command(
    prefill: Sequence[str],
    decode: Sequence[str],
    port: int,
    config: VLLMRouterConfig,
    api_key: str = "",
) -> list[str]:
    """Its command line in P/D mode; its Prometheus exporter on a free port, its
    workers checked every second at start (its default waits 30 s between checks);
    ``api_key``: what its workers ask of callers."""
    workers = [arg for url in prefill for arg in ("--prefill", url)]
    workers += [arg for url in decode for arg in ("--decode", url)]
    return _command(["--vllm-pd-disaggregation", *workers], port, config, api_key)


def regular_command(
    workers: Sequence[str], port: int, config: VLLMRouterConfig, api_key: str = ""
) -> list[str]:
    """Its command line in regular mode: one pool, each request to one worker."""
    return _command(["--worker-urls", *workers], port, config, api_key)


def _command(workers: list[str], port: int, config: VLLMRouterConfig, api_key: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "vllm_router.launch_router",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        *workers,
        "--policy",
        config.policy,
        "--worker-startup-check-interval",
        "1",
        "--log-level",
        config.log_level,
        "--prometheus-port",
        str(free_port()),
        *(["--api-key", api_key] if api_key else []),
    ]


@contextlib.contextmanager
def vllm_router(
    prefill: Sequence[str],
    decode: Sequence[str],
    config: VLLMRouterConfig | None = None,
    log: Path | None = None,
    api_key: str = "",
) -> Iterator[str]:
    """Start vLLM's router over the ``prefill`` and ``decode`` replicas; its URL once
    its ``/readiness`` says ready, stopped on the way out."""
    if not prefill or not decode:
        raise ValueError("vLLM's router in P/D mode needs prefill and decode replicas")
    config = config or VLLMRouterConfig()
    port = free_port()
    with _started(command(prefill, decode, port, config, api_key), port, config, log) as url:
        yield url


@contextlib.contextmanager
def vllm_router_regular(
    workers: Sequence[str],
    config: VLLMRouterConfig | None = None,
    log: Path | None = None,
    api_key: str = "",
) -> Iterator[str]:
    """Start vLLM's router in regular mode over ``workers``; its URL once ready."""
    if not workers:
        raise ValueError("vLLM's router needs workers")
    config = config or VLLMRouterConfig()
    port = free_port()
    with _started(regular_command(workers, port, config, api_key), port, config, log) as url:
        yield url


@contextlib.contextmanager
def _started(
    argv: list[str], port: int, config: VLLMRouterConfig, log: Path | None
) -> Iterator[str]:
    """Run ``argv``; its URL once its ``/readiness`` says ready, stopped on the way out."""

    def ready(reply: httpx.Response) -> bool:
        return reply.status_code == 200 and reply.json().get("status") == "ready"

    with router_process(
        "vLLM's router",
        argv,
        f"http://127.0.0.1:{port}",
        ready,
        "/readiness",
        config.startup_timeout_s,
        config.stop_timeout_s,
        log,
    ) as url:
        yield url
