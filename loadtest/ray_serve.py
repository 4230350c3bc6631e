"""Ray Serve's routers, and ours inside Serve, as rows of the bench.

A row labelled ``serve_<router>`` runs the workload through a Ray Serve application of
our engines (deploy/ray_serve/), started for the row with ``serve run`` on a Ray of its
own and stopped after it: engines configured as the bench's own replicas are (their
``/stats`` say how), as many, fresh. Where the bench's replicas are vLLM servers, the
application is Ray Serve LLM's, as many vLLM replicas of the same model inside it
(deploy/ray_serve/llm_app.py). The routers, by label:

- ``serve_pow2``: Serve's default, power of two choices on queue lengths;
- ``serve_prefix_affinity``: Ray Serve LLM's ``PrefixCacheAffinityRouter`` (a
  character tree of the prompts it routed, power of two choices when load is uneven);
- ``serve_<policy>``: ours inside Serve with one of our policies (``serve_cache_aware``),
  with the routing settings of the bench's gateway, its engines' events trusted without
  a join check (their canaries would count in the row).

The bench reads the engines' figures as it reads its replicas' (their own servers,
listed by the ingress's ``/engines``), and the clients' latencies as for every row.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

from deploy.processes import free_port, stop, wait_until
from deploy.ray_serve.config import ServeApp, ServeLLMApp
from replica.api.config import ReplicaConfig
from router.config import GatewayConfig
from router.policies import POLICIES

PREFIX = "serve_"
#: Serve's own routers, by label; any other ``serve_`` label is ours with that policy.
SERVE_ROUTERS = {"serve_pow2": "pow2", "serve_prefix_affinity": "prefix_affinity"}
#: What replays a row: Serve's default is our ``power_of_two`` (queue lengths, two
#: choices); ours is its policy; Serve LLM's has no twin.
REPLAYED_AS = {"serve_pow2": "power_of_two"}


def is_serve(label: str) -> bool:
    return label.startswith(PREFIX)


def replayed_as(label: str) -> str | None:
    """The policy whose replay predicts the row (``None``: none does)."""
    if label in SERVE_ROUTERS:
        return REPLAYED_AS.get(label)
    return label.removeprefix(PREFIX)


def application(
    label: str, engine: ReplicaConfig, replicas: int, gateway: GatewayConfig
) -> ServeApp:
    """The Serve application a row runs on: ``replicas`` engines like ``engine``,
    routed as ``label`` says (ours with ``gateway``'s routing settings)."""
    router, kwargs = _router(label, gateway)
    return ServeApp(
        router=router,
        router_kwargs=kwargs,
        engine=dataclasses.asdict(engine),
        replicas=replicas,
        port=free_port(),
    )


def llm_application(label: str, replicas: int, gateway: GatewayConfig) -> ServeLLMApp:
    """The Serve LLM application a row runs on when the bench's engines are vLLM servers:
    ``replicas`` vLLM replicas of the gateway's model inside Serve LLM, routed as
    ``label`` says (ours with ``gateway``'s routing settings), vLLM's development
    endpoints on so that the bench empties their caches as it does its own servers'."""
    router, kwargs = _router(label, gateway)
    return ServeLLMApp(gateway.model, router, kwargs, replicas, port=free_port(), dev_mode=True)


@contextlib.contextmanager
def running(
    app: ServeApp | ServeLLMApp, out: Path, timeout_s: float = 300.0
) -> Iterator[tuple[str, list[str]]]:
    """``serve run`` of ``app`` (its config in ``out``, its log beside), on a Ray of its
    own; the ingress's URL and the engines' once every engine serves; stopped (Serve,
    then its Ray) however the row ends."""
    out.mkdir(parents=True, exist_ok=True)
    config = out / "serve_config.yaml"
    config.write_text(app.yaml())
    serve = os.path.join(os.path.dirname(sys.executable), "serve")
    # a Ray of its own (never the bench's deployment's), on loopback
    env = {**os.environ, "RAY_ADDRESS": "local", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
    with open(out / "serve.log", "w") as log:
        process = subprocess.Popen(
            [serve, "run", str(config)],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
    url = f"http://127.0.0.1:{app.port}"
    try:

        def ready(answer: httpx.Response) -> bool:
            return answer.status_code == 200 and len(answer.json()) == app.replicas

        wait_until(url, process, ready, path="/engines", timeout_s=timeout_s)
        checked(url, timeout_s, app.model if isinstance(app, ServeLLMApp) else None)
        yield url, httpx.get(f"{url}/engines", timeout=10).json()
    finally:
        stop(process, timeout_s=60)


def _router(label: str, gateway: GatewayConfig) -> tuple[str, dict[str, Any]]:
    """The router a row's label names, and its settings (ours: the gateway's routing)."""
    if label in SERVE_ROUTERS:
        return SERVE_ROUTERS[label], {}
    policy = label.removeprefix(PREFIX)
    if policy not in POLICIES:
        known = ", ".join([*SERVE_ROUTERS, *(PREFIX + p for p in POLICIES)])
        raise ValueError(f"unknown Ray Serve row {label!r}: one of {known}")
    routing = dataclasses.asdict(gateway.routing)
    # No join checks: the engines are set up as the bench's replicas, and a check's
    # canary prompt, sent by a router Serve makes during the row, would count in the row
    # (one did under a busy machine's CI, the warm-up notwithstanding).
    return "prefix", {"policy": policy, "routing": routing, "check_backends": False}


def checked(url: str, timeout_s: float, model: str | None = None) -> None:
    """Wake the application's request router (Serve makes it at the first request) and
    wait until ours has checked every engine, as the bench waits for its gateways: a
    check's canary prompts, answered during a row, would count in it (the bench empties
    the engines before the row). ``model``: the one to name (Serve LLM's ingress asks)."""
    body = {"prompt": "warm-up", "max_tokens": 1, **({"model": model} if model else {})}
    httpx.post(f"{url}/v1/completions", json=body, timeout=timeout_s).raise_for_status()
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        stats = httpx.get(f"{url}/stats", timeout=10)
        if stats.status_code != 200:  # Serve's own router: nothing to check
            return
        if all(b["routing_mode"] != "checking" for b in stats.json()["backends"]):
            return
        time.sleep(0.2)
    raise TimeoutError(f"{url}: the request router still checks its engines after {timeout_s} s")
