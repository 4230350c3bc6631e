"""Our replicas as a Ray Serve application, routed by our policies inside Serve
(deploy/ray_serve/), on a local Ray (`serve deploy` onto a `ray start` cluster:
test_ray_serve_cluster.py); and Ray Serve LLM's own vLLM replica (vLLM's CPU build in
the replica's process) routed by ours (deploy/ray_serve/llm_app.py), the application the
shipped config file describes, with the tiny model."""

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
import ray
import yaml
from ray import serve

from deploy.local import start_local_ray
from deploy.processes import free_port
from deploy.ray_serve.app import build_app
from deploy.ray_serve.llm_app import build_openai_app
from replica.api.fleet_token import ENV_FLEET_TOKEN, bearer
from replica.vllm_server import SHARED_CACHE
from tests.shared import leaves_no_vllm_behind, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.ray]

APP = "prefix-router-test"
#: A system prompt of 62 blocks of the simulated tokenizer (4 bytes a token, 16 a block).
SYSTEM = "You answer questions about caches. " * 113
LLM_APP = "prefix-router-llm-test"
LLM_CONFIG_FILE = Path(__file__).parents[2] / "deploy" / "ray_serve" / "serve_llm_config.yaml"
TOKEN = "the-fleets-token"
#: A system prompt of some 25 blocks of 32 of the tiny model's tokens.
LLM_SYSTEM = "You answer questions about caches, briefly and well. " * 40


@pytest.fixture(scope="module")
def proxy() -> Iterator[str]:
    """A local Ray with Serve's HTTP proxy on a loopback port; its URL; both stopped
    however the tests end."""
    start_local_ray(num_cpus=2)
    port = free_port()
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


def deploy(replicas: int, router: str = "prefix", **autoscaling: Any) -> None:
    """Our application with ``replicas`` engines (as many as Serve's autoscaler wants
    from there, with ``autoscaling``)."""
    args = {"replicas": replicas, "router": router, "autoscaling": autoscaling}
    serve.run(build_app({**args, "engine": {"speedup": 100.0}}), name=APP, route_prefix="/")


def chat(client: httpx.Client, system: str, question: str) -> int:
    """One chat; the prompt tokens the engine found cached."""
    messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
    answer = client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 2})
    assert answer.status_code == 200, answer.text
    return int(answer.json()["usage"]["prompt_tokens_details"]["cached_tokens"])


def backends(client: httpx.Client) -> dict[str, int]:
    """The engines our request router routes to, by Serve replica id: their requests."""
    stats = client.get("/stats")
    assert stats.status_code == 200, stats.text
    return {b["replica_id"]: b["dispatched"] for b in stats.json()["backends"]}


def test_a_warmed_prefix_goes_to_the_replica_that_holds_it(proxy):
    deploy(replicas=3)
    with httpx.Client(base_url=proxy, timeout=60) as client:
        assert chat(client, SYSTEM, "first?") == 0
        warmed = backends(client)
        holder = max(warmed, key=lambda replica: warmed[replica])
        cached = [chat(client, SYSTEM, f"question {i}?") for i in range(8)]
        # Serve's own router would send two in three of them elsewhere, cached nowhere
        assert min(cached) >= 16 * 62, cached
        after = backends(client)
        assert after[holder] - warmed[holder] == 8
        assert len(client.get("/engines").json()) == 3  # each engine's own server
        # the gateway's dashboard, drawn from this router: the 9 requests, where they went
        assert "<html" in client.get("/dashboard").text.lower()
        view = client.get("/dashboard/data").json()
        assert view["requests"] == 9 and view["backends"] == 3
        assert sum(r["dispatched"] for r in view["replicas"]) == 9
    serve.delete(APP)


def test_an_engine_serve_adds_is_routed_to_and_one_it_removes_is_forgotten(proxy):
    # Serve's autoscaler, made quick: more than 2 requests at once on an engine adds one
    quick = {"upscale_delay_s": 0, "downscale_delay_s": 2, "look_back_period_s": 1}
    deploy(replicas=1, max_replicas=3, target_ongoing_requests=2, metrics_interval_s=0.5, **quick)
    with httpx.Client(base_url=proxy, timeout=60) as client:
        chat(client, SYSTEM, "warm the router")
        first = set(backends(client))
        assert len(first) == 1

        def long_answers(n: int) -> None:
            # at 100x, 400 tokens take about 0.5 s each: the requests overlap
            body = {"prompt": SYSTEM + str(n), "max_tokens": 400, "ignore_eos": True}
            with httpx.Client(base_url=proxy, timeout=60) as own:
                assert own.post("/v1/completions", json=body).status_code == 200

        def added_engine_routed() -> bool:
            with ThreadPoolExecutor(8) as pool:
                list(pool.map(long_answers, range(16)))
            routed = backends(client)
            return any(n for replica, n in routed.items() if replica not in first)

        wait_for(added_engine_routed, timeout_s=120, what="an engine Serve added, routed to")
        # idle: Serve removes the added engines; the router forgets them
        wait_for(lambda: len(backends(client)) == 1, timeout_s=120, what="the engines forgotten")
        assert chat(client, SYSTEM, "still served?") >= 0
    serve.delete(APP)


def test_serve_llms_and_serves_own_routers_run_the_same_application(proxy):
    """The comparison's other two routers, on the same application: every request
    answered (the bench measures how well they route)."""
    with httpx.Client(base_url=proxy, timeout=60) as client:
        for router in ("pow2", "prefix_affinity"):
            deploy(replicas=2, router=router)
            assert [chat(client, SYSTEM, f"q{i}") >= 0 for i in range(3)] == [True] * 3
            assert client.get("/stats").status_code == 404  # not ours: nothing to show
            serve.delete(APP)


def application_args(model: Path) -> dict[str, Any]:
    """The shipped config file's application, ``model`` its model's source, one replica."""
    (application,) = yaml.safe_load(LLM_CONFIG_FILE.read_text())["applications"]
    args: dict[str, Any] = application["args"]
    (config,) = args["llm_configs"]
    config["model_loading_config"]["model_source"] = str(model)
    config["deployment_config"]["num_replicas"] = 1
    # vLLM's cache shared with the suite's other servers: a start without the model's
    # inspection, which takes a subprocess importing torch
    config["runtime_env"]["env_vars"]["VLLM_CACHE_ROOT"] = str(SHARED_CACHE)
    # the fleet's token, in the replica's process (its server's guard) and the
    # ingress's (where the router reads the replica with it)
    config["runtime_env"]["env_vars"][ENV_FLEET_TOKEN] = TOKEN
    ingress = args["ingress_deployment_config"]["ray_actor_options"]
    ingress["runtime_env"] = {"env_vars": {ENV_FLEET_TOKEN: TOKEN}}
    return args


def llm_chat(client: httpx.Client, question: str) -> int:
    """One chat to the tiny model after the system prompt; the tokens vLLM found cached."""
    messages = [{"role": "system", "content": LLM_SYSTEM}, {"role": "user", "content": question}]
    body = {"model": "tiny", "messages": messages, "max_tokens": 2}
    answer = client.post("/v1/chat/completions", json=body)
    assert answer.status_code == 200, answer.text
    return int(answer.json()["usage"]["prompt_tokens_details"]["cached_tokens"])


@pytest.mark.vllm
def test_a_serve_llm_replica_joins_our_router_precise_and_its_cache_is_known(proxy, tiny_model):
    """One replica: choosing among replicas is the router's, tested above on our
    engines; what is Serve LLM's here is how a replica joins and a request reads (and a
    vLLM start is the suite's time)."""
    with leaves_no_vllm_behind(timeout_s=60):
        serve.run(build_openai_app(application_args(tiny_model)), name=LLM_APP, route_prefix="/")
        try:
            with httpx.Client(base_url=proxy, timeout=120) as client:
                served_and_known(client)
        finally:
            serve.delete(LLM_APP)


def served_and_known(client: httpx.Client) -> None:
    """The replica joined precise, every chat read and placed, its cache known."""
    assert llm_chat(client, "first?") == 0
    stats = client.get("/stats")
    assert stats.status_code == 200, stats.text
    (backend,) = stats.json()["backends"]
    # joined as a vLLM server: its card, its events, its check passed
    assert backend["engine"] == "vllm" and backend["model"] == "tiny"
    assert backend["block_size"] == 32
    assert backend["routing_mode"] == "precise", backend["approximate_reason"]
    assert backend["unchecked"] == [] and backend["kv_stream"]["gaps"] == 0

    cached = [llm_chat(client, f"question {i}?") for i in range(3)]
    assert min(cached) >= 32 * 24, cached
    (backend,) = client.get("/stats").json()["backends"]
    # every chat read and placed by our policy (Serve LLM's parsed request read back)
    assert backend["by_policy"]["cache_aware"]["requests"] == backend["dispatched"] == 4
    assert backend["unkeyed_blocks"] == 0 and backend["event_disagreements"] == 0
    # the router knows, from the engine's own events, what it holds of the prompt
    view = client.get("/dashboard/data").json()
    assert view["requests"] == 4
    (hottest, *_) = view["hot_prefixes"]
    (holder,) = hottest["holders"]
    assert holder["replica_id"] == backend["replica_id"]
    assert holder["gpu_tokens"] >= 32 * 24
    assert client.get("/engines").json() == [backend["url"]]
    # the replica's own server answers the fleet's token only, as our replicas do
    assert httpx.get(f"{backend['url']}/metrics").status_code == 401
    assert httpx.get(f"{backend['url']}/metrics", headers=bearer(TOKEN)).status_code == 200
