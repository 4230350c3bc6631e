"""The Serve config file of our application (deploy/ray_serve/serve_config.yaml is one):
what ``prefix-router serve-config`` writes, for ``serve run`` and ``serve deploy``.

Kept apart from the application so that writing it imports neither Ray Serve nor the
engine.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from deploy.ray_serve.batching import DEFAULT_INTERVAL_MS

APP_NAME = "prefix-router"
IMPORT_PATH = "deploy.ray_serve.app:build_app"
#: Ray Serve LLM's application of vLLM replicas, routed by ours (llm_app.py), as shipped.
LLM_CONFIG_FILE = Path(__file__).with_name("serve_llm_config.yaml")
ENGINE = "PrefixEngine"
INGRESS = "OpenAIIngress"

#: The request routers an application may route its engines with, by name: ours,
#: Serve's default (power of two choices) and Ray Serve LLM's prefix-affinity router.
ROUTERS = {
    "prefix": "deploy.ray_serve.request_router:PrefixRequestRouter",
    "pow2": "ray.serve._private.request_router:PowerOfTwoChoicesRequestRouter",
    "prefix_affinity": (
        "ray.llm._internal.serve.routing_policies.prefix_aware.prefix_aware_router"
        ":PrefixCacheAffinityRouter"
    ),
}


@dataclass(frozen=True)
class ServeApp:
    """One application of our engines behind one ingress."""

    router: str = "prefix"
    #: The router's settings (ours: ``policy`` and any gateway field by name).
    router_kwargs: dict[str, Any] = field(default_factory=dict)
    #: The engine's settings: replica/api/config.py's fields by name.
    engine: dict[str, Any] = field(default_factory=dict)
    #: Engines: a fixed count, or where Serve's autoscaler starts.
    replicas: int = 2
    #: Serve's ``autoscaling_config`` for the engines (empty: a fixed count), whose
    #: ``min_replicas`` is ``replicas`` unless it says.
    autoscaling: dict[str, Any] = field(default_factory=dict)
    host: str = "127.0.0.1"
    port: int = 8000
    #: How long an engine replica gathers an answer's tokens after the first before
    #: passing them on as one item (0: each as it comes): Ray Serve LLM's
    #: ``stream_batching_interval_ms``, whose default it takes (deploy/ray_serve/batching.py).
    stream_batching_interval_ms: float = DEFAULT_INTERVAL_MS

    def __post_init__(self) -> None:
        _check_router(self.router)
        if self.replicas < 1:
            raise ValueError(f"replicas must be at least 1, got {self.replicas}")
        if self.stream_batching_interval_ms < 0:
            raise ValueError("stream_batching_interval_ms must not be negative")
        most = self.autoscaling.get("max_replicas", self.replicas)
        if most < self.autoscaling.get("min_replicas", self.replicas):
            raise ValueError(f"max_replicas ({most}) is below the least replicas")

    def args(self) -> dict[str, Any]:
        """The application's arguments (``build_app``'s)."""
        return {
            "router": self.router,
            "router_kwargs": dict(self.router_kwargs),
            "engine": dict(self.engine),
            "replicas": self.replicas,
            "autoscaling": dict(self.autoscaling),
            "stream_batching_interval_ms": self.stream_batching_interval_ms,
        }

    def autoscaling_config(self) -> dict[str, Any] | None:
        """Serve's ``autoscaling_config`` for the engines (``None``: a fixed count)."""
        if not self.autoscaling:
            return None
        return {"min_replicas": self.replicas, **self.autoscaling}

    def config(self) -> dict[str, Any]:
        """The whole Serve config file, as a dict."""
        application: dict[str, Any] = {
            "name": APP_NAME,
            "route_prefix": "/",
            "import_path": IMPORT_PATH,
            "args": self.args(),
        }
        return {
            "proxy_location": "HeadOnly",
            "http_options": {"host": self.host, "port": self.port},
            "applications": [application],
        }

    def yaml(self) -> str:
        header = (
            "# prefix-router on Ray Serve (deploy/ray_serve/): `serve run FILE`, or\n"
            "# `serve deploy FILE` onto a `ray start` cluster.\n"
        )
        return header + yaml.safe_dump(self.config(), sort_keys=False)


@dataclass(frozen=True)
class ServeLLMApp:
    """Ray Serve LLM's application of vLLM replicas (deploy/ray_serve/llm_app.py): the
    shipped config file's, serving another model with another router and count."""

    #: The model's folder, also its name in requests (as ``prefix-router serve`` names it).
    model: str
    router: str = "prefix"
    router_kwargs: dict[str, Any] = field(default_factory=dict)
    replicas: int = 2
    host: str = "127.0.0.1"
    port: int = 8000
    #: vLLM's development endpoints on (``/reset_prefix_cache``, which a bench asks).
    dev_mode: bool = False

    def __post_init__(self) -> None:
        _check_router(self.router)

    def config(self) -> dict[str, Any]:
        """The whole Serve config file, as a dict."""
        config: dict[str, Any] = yaml.safe_load(LLM_CONFIG_FILE.read_text())
        config["http_options"] = {"host": self.host, "port": self.port}
        (application,) = config["applications"]
        (llm,) = application["args"]["llm_configs"]
        llm["model_loading_config"] = {"model_id": self.model, "model_source": self.model}
        deployment = llm["deployment_config"]
        deployment["num_replicas"] = self.replicas
        deployment["request_router_config"] = {
            "request_router_class": ROUTERS[self.router],
            "request_router_kwargs": dict(self.router_kwargs),
        }
        if self.dev_mode:
            llm["runtime_env"]["env_vars"]["VLLM_SERVER_DEV_MODE"] = "1"
        return config

    def yaml(self) -> str:
        header = "# Ray Serve LLM's vLLM replicas (deploy/ray_serve/llm_app.py): `serve run FILE`\n"
        return header + yaml.safe_dump(self.config(), sort_keys=False)


def _check_router(router: str) -> None:
    if router not in ROUTERS:
        raise ValueError(f"unknown router {router!r}: one of {', '.join(ROUTERS)}")
