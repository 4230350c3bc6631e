"""SGLang's router, the real binary, in front of our replicas: started, used, and
stopped however the caller ends."""

import httpx
import psutil
import pytest

from deploy.processes import free_port, running
from loadtest.sglang import SGLangRouterConfig, sglang_router
from replica.api.fleet_token import ENV_FLEET_TOKEN, bearer
from replica.api.identity import DEFAULT_MODEL
from tests.shared import replica_stats

pytestmark = pytest.mark.slow

TOKEN = "the-fleets-token"


def routers_over(worker: str) -> list[psutil.Process]:
    """SGLang's router processes given ``worker`` (a URL on a port of this test's own)."""
    found = []
    for process in psutil.process_iter(["cmdline"]):
        command = " ".join(process.info["cmdline"] or [])
        if "sglang_router.launch_router" in command and worker in command:
            found.append(process)
    return found


def test_it_routes_to_our_replica_and_stops_when_the_caller_fails(tmp_path):
    log = tmp_path / "router.log"
    # the replica asks the fleet's token: the router holds it (its one key, which it
    # asks of its own clients too)
    with running(["replica", "--speedup", "20"], env={ENV_FLEET_TOKEN: TOKEN}) as (replica,):
        with pytest.raises(RuntimeError, match="the caller failed"):  # noqa: SIM117
            with sglang_router([replica], log=log, api_key=TOKEN) as router:
                body = {"model": DEFAULT_MODEL, "prompt": "Hello, fleet. " * 40, "max_tokens": 4}
                for _ in range(2):
                    answer = httpx.post(
                        router + "/v1/completions", json=body, headers=bearer(TOKEN), timeout=30
                    )
                    assert answer.status_code == 200, answer.text
                # The second time, our replica had the prompt's blocks cached.
                assert answer.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
                assert replica_stats(replica, TOKEN).requests == 2
                raise RuntimeError("the caller failed")
        assert routers_over(replica) == []
        with pytest.raises(httpx.ConnectError):
            httpx.get(router + "/health", timeout=2)


def test_a_router_whose_workers_never_answer_is_reported_and_stopped(tmp_path):
    nowhere = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    config = SGLangRouterConfig(startup_timeout_s=5)
    with pytest.raises((TimeoutError, RuntimeError)):  # noqa: SIM117
        with sglang_router([nowhere], config, log=tmp_path / "router.log"):
            pass
    assert routers_over(nowhere) == []


def test_its_config_names_a_bad_field():
    with pytest.raises(ValueError, match="startup_timeout_s"):
        SGLangRouterConfig(startup_timeout_s=0)
