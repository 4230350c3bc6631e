"""The bench's Ray Serve rows: which application each label runs, and what replays it."""

import dataclasses

import pytest

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
