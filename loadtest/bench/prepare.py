"""Before each run: every replica's cache emptied, every gateway switched to the policy."""

from __future__ import annotations

import contextlib
import time

import httpx

from loadtest.bench.targets import Fleet


def reset(client: httpx.Client, fleet: Fleet, timeout_s: float = 120.0) -> bool:
    """Empty every replica's cache (and our replicas' statistics); True if all did.

    Ours answer ``POST /reset`` (409 while requests are in flight), vLLM
    ``/reset_prefix_cache`` (``{"success": false}`` while blocks are held), SGLang
    ``/flush_cache``; a busy replica is asked again until ``timeout_s``.
    """
    done = []
    for url in fleet.replicas:
        deadline = time.monotonic() + timeout_s
        outcome = _reset(client, url)
        while outcome is False and time.monotonic() < deadline:
            time.sleep(0.5)
            outcome = _reset(client, url)
        done.append(bool(outcome))
    return bool(done) and all(done)


def _reset(client: httpx.Client, url: str) -> bool | None:
    """True: emptied; False: busy, ask again; None: it cannot be emptied."""
    answer = _post(client, f"{url}/reset")
    if answer is None or answer.status_code not in (404, 405):
        return None if answer is None else {200: True, 409: False}.get(answer.status_code)
    vllm = _post(client, f"{url}/reset_prefix_cache")
    if vllm is not None and vllm.status_code == 200:
        with contextlib.suppress(ValueError):
            return bool(vllm.json().get("success", True))
        return True
    sglang = _post(client, f"{url}/flush_cache")
    return True if sglang is not None and sglang.status_code == 200 else None


def _post(client: httpx.Client, url: str) -> httpx.Response | None:
    try:
        return client.post(url)
    except httpx.HTTPError:
        return None


def switch_policy(client: httpx.Client, fleet: Fleet, policy: str) -> None:
    for gateway in fleet.gateways:
        response = client.post(f"{gateway}/admin/policy", json={"policy": policy})
        if response.status_code != 200:
            raise ValueError(f"gateway {gateway} refused policy {policy!r}: {response.text}")
