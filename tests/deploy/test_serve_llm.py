"""Ray Serve LLM's own vLLM replicas (``LLMServer``, vLLM's CPU build in the replica's
process) routed by our request router (deploy/ray_serve/llm_app.py), on a local Ray:
the application the shipped config file describes, with the tiny model."""

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import ray
import yaml
from ray import serve

from deploy.local import start_local_ray
from deploy.processes import free_port
from deploy.ray_serve.llm_app import build_openai_app
from replica.vllm_server import SHARED_CACHE
from tests.shared import leaves_no_vllm_behind

pytestmark = [pytest.mark.slow, pytest.mark.ray, pytest.mark.vllm]

CONFIG_FILE = Path(__file__).parents[2] / "deploy" / "ray_serve" / "serve_llm_config.yaml"
#: A system prompt of some 25 blocks of 32 of the tiny model's tokens.
SYSTEM = "You answer questions about caches, briefly and well. " * 40


def application_args(model: Path) -> dict[str, Any]:
    """The shipped config file's application, ``model`` its model's source, one replica."""
    (application,) = yaml.safe_load(CONFIG_FILE.read_text())["applications"]
    args: dict[str, Any] = application["args"]
    (config,) = args["llm_configs"]
    config["model_loading_config"]["model_source"] = str(model)
    config["deployment_config"]["num_replicas"] = 1
    # vLLM's cache shared with the suite's other servers: a start without the model's
    # inspection, which takes a subprocess importing torch
    config["runtime_env"]["env_vars"]["VLLM_CACHE_ROOT"] = str(SHARED_CACHE)
    return args


@pytest.fixture(scope="module")
def proxy(tiny_model: Path) -> Iterator[str]:
    """Serve LLM's application of one vLLM replica behind Serve's HTTP proxy on a
    loopback port; its URL. Ray, Serve, the engine and its folder are gone however the
    test ends. One replica: choosing among replicas is the router's, tested on our
    engines (test_ray_serve.py); what is Serve LLM's here is how a replica joins and
    how a request reads (and vLLM's start is the suite's time)."""
    with leaves_no_vllm_behind(timeout_s=60):
        start_local_ray(num_cpus=2)  # as this machine: a core per replica's engine
        port = free_port()
        try:
            serve.start(http_options={"host": "127.0.0.1", "port": port})
            serve.run(build_openai_app(application_args(tiny_model)), name="llm", route_prefix="/")
            yield f"http://127.0.0.1:{port}"
        finally:
            serve.shutdown()
            ray.shutdown()


def chat(client: httpx.Client, question: str) -> int:
    """One chat after the system prompt; the prompt tokens vLLM found cached."""
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
    body = {"model": "tiny", "messages": messages, "max_tokens": 2}
    answer = client.post("/v1/chat/completions", json=body)
    assert answer.status_code == 200, answer.text
    return int(answer.json()["usage"]["prompt_tokens_details"]["cached_tokens"])


def test_a_serve_llm_replica_joins_our_router_precise_and_its_cache_is_known(proxy):
    with httpx.Client(base_url=proxy, timeout=120) as client:
        assert chat(client, "first?") == 0
        stats = client.get("/stats")
        assert stats.status_code == 200, stats.text
        (backend,) = stats.json()["backends"]
        # joined as a vLLM server: its card, its events, its check passed
        assert backend["engine"] == "vllm" and backend["model"] == "tiny"
        assert backend["block_size"] == 32
        assert backend["routing_mode"] == "precise", backend["approximate_reason"]
        assert backend["unchecked"] == [] and backend["kv_stream"]["gaps"] == 0

        cached = [chat(client, f"question {i}?") for i in range(3)]
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
