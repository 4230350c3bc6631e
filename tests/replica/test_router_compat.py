"""Another project's router in front of our replicas: SGLang's (on PyPI as sglang-router)."""

import os
import subprocess
import sys
import time

import httpx
import pytest

from deploy.processes import free_port, running

pytestmark = pytest.mark.slow

# The router fetches a tokenizer for the model it finds; keep that on loopback, where
# nothing answers, so it falls back to routing text (this machine has no other network).
OFFLINE = {**os.environ, "HF_ENDPOINT": "http://127.0.0.1:9", "HF_HUB_OFFLINE": "1"}


def test_sglang_router_fronts_two_replicas_with_its_cache_aware_policy():
    replica = ["replica", "--speedup", "20"]
    with running(replica, replica) as replicas:
        port = free_port()
        router = [sys.executable, "-m", "sglang_router.launch_router"]
        address = ["--host", "127.0.0.1", "--port", str(port)]
        command = [*router, *address, "--worker-urls", *replicas, "--policy", "cache_aware"]
        command += ["--log-level", "error"]
        router = subprocess.Popen(
            command, env=OFFLINE, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
        )
        url = f"http://127.0.0.1:{port}"
        try:
            body = {
                "model": "sim-llama3-8b",
                "prompt": "Shared instructions. " * 80,
                "max_tokens": 3,
            }
            replies = []
            deadline = time.monotonic() + 60
            while len(replies) < 4 and time.monotonic() < deadline:
                try:
                    response = httpx.post(url + "/v1/completions", json=body, timeout=30)
                except httpx.HTTPError:
                    time.sleep(0.2)  # the router is still starting
                    continue
                if response.status_code == 200:
                    replies.append(response.json())
                else:
                    time.sleep(0.2)
            assert len(replies) == 4, (
                router.stderr.read() if router.poll() is not None else "no replies"
            )
            cached = [r["usage"]["prompt_tokens_details"]["cached_tokens"] for r in replies]
            # Its cache-aware policy sent every repeat where the prefix is (round robin
            # would have sent the second to the other replica, and cached nothing there).
            assert cached[0] == 0 and min(cached[1:]) > 300
            served = [httpx.get(r + "/stats").json()["requests"] for r in replicas]
            assert sorted(served) == [0, 4]
        finally:
            router.terminate()
            router.wait(timeout=30)
