"""The bench's Ray Serve rows: which application each label runs, and what replays it."""

import dataclasses

import pytest

from deploy.ray_serve.config import ROUTERS
from loadtest import ray_serve
from replica.api.config import ReplicaConfig
from router.config import GatewayConfig

ENGINE = ReplicaConfig(num_blocks=512, speedup=4.0)


def test_serves_own_routers_run_the_application_with_their_own_settings_only():
    for label, router in [("serve_pow2", "pow2"), ("serve_prefix_affinity", "prefix_affinity")]:
        app = ray_serve.application(label, ENGINE, 3, GatewayConfig())
        assert (app.router, app.router_kwargs, app.replicas) == (router, {}, 3)
    assert ray_serve.replayed_as("serve_pow2") == "power_of_two"
    assert ray_serve.replayed_as("serve_prefix_affinity") is None  # no twin of Serve LLM's


def test_ours_inside_serve_takes_the_policy_from_its_label_and_the_gateways_routing():
    gateway = GatewayConfig()
    app = ray_serve.application("serve_cache_aware_ttft", ENGINE, 2, gateway)
    assert app.router == "prefix" and app.router_kwargs["policy"] == "cache_aware_ttft"
    assert app.router_kwargs["routing"] == dataclasses.asdict(gateway.routing)
    assert app.router_kwargs["check_backends"] is False  # no canary counted in a row
    assert ray_serve.replayed_as("serve_cache_aware_ttft") == "cache_aware_ttft"
    # the engines are the bench's replicas, setting for setting
    assert ReplicaConfig(**app.engine) == ENGINE


def test_an_unknown_serve_row_names_the_rows_there_are():
    with pytest.raises(ValueError, match="unknown Ray Serve row 'serve_nope': one of serve_pow2"):
        ray_serve.application("serve_nope", ENGINE, 2, GatewayConfig())


def test_on_vllm_replicas_a_row_runs_serve_llms_application_of_the_same_model():
    gateway = GatewayConfig(model="/models/tiny")
    app = ray_serve.llm_application("serve_cache_aware", 3, gateway)
    (application,) = app.config()["applications"]
    assert application["import_path"] == "deploy.ray_serve.llm_app:build_openai_app"
    (llm,) = application["args"]["llm_configs"]
    # named in requests as the bench names it, loaded from the same folder
    assert llm["model_loading_config"] == {
        "model_id": "/models/tiny",
        "model_source": "/models/tiny",
    }
    routed = llm["deployment_config"]
    assert routed["num_replicas"] == 3
    kwargs = routed["request_router_config"]["request_router_kwargs"]
    assert kwargs["policy"] == "cache_aware" and kwargs["check_backends"] is False
    assert kwargs["routing"] == dataclasses.asdict(gateway.routing)
    # the bench empties their caches between rows, as it does its own vLLM servers'
    assert llm["runtime_env"]["env_vars"]["VLLM_SERVER_DEV_MODE"] == "1"
    pow2 = ray_serve.llm_application("serve_pow2", 2, gateway).config()
    (llm,) = pow2["applications"][0]["args"]["llm_configs"]
    router = llm["deployment_config"]["request_router_config"]
    assert router == {"request_router_class": ROUTERS["pow2"], "request_router_kwargs": {}}
