"""Ray Serve LLM's OpenAI application, its vLLM replicas routed by our request router.

    serve run deploy/ray_serve/serve_llm_config.yaml

:func:`build_openai_app` takes what Ray Serve LLM's own ``build_openai_app`` takes (the
same ``llm_configs``, the same config file under another ``import_path``) and builds
the same application, with three differences:

- each model's replicas are :class:`~deploy.ray_serve.llm_server.PrefixLLMServer`
  (Serve LLM's ``LLMServer``, its KV events and its own vLLM server said to the
  router), unless its config names a ``server_cls``;
- each model's deployment is routed by our request router (``cache_aware``), unless
  its ``deployment_config`` names a ``request_router_config`` (Serve's default or
  Serve LLM's routers, compared on the same replicas);
- the ingress also answers ``/stats`` and ``/dashboard``, drawn from the router of its
  handle to a model's replicas (``?model=`` where it serves several), and ``/engines``:
  the replicas' own vLLM servers.
"""

from __future__ import annotations

from typing import Any, cast

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response
from fastapi.staticfiles import StaticFiles
from ray import serve
from ray.llm._internal.common.dict_utils import maybe_apply_llm_deployment_config_defaults
from ray.llm._internal.serve.core.configs.llm_config import LLMConfig, LoraConfig
from ray.llm._internal.serve.core.configs.openai_api_models import to_model_metadata
from ray.llm._internal.serve.core.ingress.builder import LLMServingArgs
from ray.llm._internal.serve.core.ingress.ingress import (
    DEFAULT_ENDPOINTS,
    OpenAiIngress,
    init,
    make_fastapi_ingress,
)
from ray.llm._internal.serve.core.server.builder import build_llm_deployment
from ray.serve.deployment import Application

from deploy.ray_serve import directory, views
from deploy.ray_serve.llm_server import PrefixLLMServer, prefix_router_config
from router.http.dashboard import STATIC

#: The ingress's routes beyond Serve LLM's, by method name.
VIEWS = {
    "stats": lambda app: app.get("/stats"),
    "dashboard": lambda app: app.get("/dashboard", include_in_schema=False),
    "dashboard_data": lambda app: app.get("/dashboard/data", include_in_schema=False),
    "engines": lambda app: app.get("/engines"),
}


class PrefixOpenAiIngress(OpenAiIngress):
    """Serve LLM's OpenAI ingress, with our router's ``/stats`` and dashboard."""

    async def stats(self, model: str | None = None) -> Response:
        """The router of the handle to ``model``'s replicas (the only model's, unsaid),
        as the gateway's ``/stats``."""
        deployment = self._deployment_of(model)
        if deployment is None:
            return JSONResponse({"error": f"say which model: {self._models()}"}, 404)
        return await views.stats(deployment)

    async def dashboard(self) -> Response:
        return views.dashboard()

    async def dashboard_data(
        self, since: float = 0.0, text: bool = False, model: str | None = None
    ) -> Response:
        deployment = self._deployment_of(model)
        if deployment is None:
            return JSONResponse({"error": f"say which model: {self._models()}"}, 404)
        return await views.dashboard_data(deployment, since, text)

    async def engines(self) -> list[str]:
        """The vLLM servers of the replicas (their ``/metrics``), whatever the router."""
        return directory.app_engine_urls()

    def _deployment_of(self, model: str | None) -> str | None:
        handles = self._default_serve_handles
        if model is None and len(handles) == 1:
            (model,) = handles
        handle = handles.get(model) if model is not None else None
        return handle.deployment_id.name if handle is not None else None

    def _models(self) -> list[str]:
        return sorted(self._default_serve_handles)


def routed_by_prefix_router(config: LLMConfig) -> LLMConfig:
    """``config`` with our replica class and request router where it names none."""
    if config.server_cls is None:
        config.server_cls = PrefixLLMServer
    if "request_router_config" not in config.deployment_config:
        config.deployment_config["request_router_config"] = prefix_router_config()
    return config


def build_openai_app(builder_config: dict[str, Any]) -> Application:
    """Serve LLM's OpenAI application (``ray.serve.llm.build_openai_app``'s arguments),
    routed by our request router: see the module's doc."""
    args = LLMServingArgs.model_validate(builder_config)  # its configs: LLMConfigs now
    configs = [routed_by_prefix_router(cast(LLMConfig, config)) for config in args.llm_configs]
    deployments = {config.model_id: build_llm_deployment(config) for config in configs}
    cards = {config.model_id: to_model_metadata(config.model_id, config) for config in configs}
    lora_paths = {
        config.model_id: cast(LoraConfig, config.lora_config).dynamic_lora_loading_path
        for config in configs
        if config.lora_config is not None
    }
    options = maybe_apply_llm_deployment_config_defaults(
        PrefixOpenAiIngress.get_deployment_options(configs), args.ingress_deployment_config
    )
    ingress = make_fastapi_ingress(
        PrefixOpenAiIngress, endpoint_map={**DEFAULT_ENDPOINTS, **VIEWS}, app=_ingress_app()
    )
    deployment: Any = serve.deployment(ingress, **options)
    return deployment.bind(llm_deployments=deployments, model_cards=cards, lora_paths=lora_paths)


def _ingress_app() -> FastAPI:
    """Serve LLM's ingress app (its middleware), with the dashboard's files."""
    app = init()
    app.mount("/dashboard/static", StaticFiles(directory=STATIC), name="dashboard-static")
    return app
