"""What an ingress shows of its request router: the gateway's ``/stats`` and dashboard,
drawn from the router that routes its handle's requests in this process (``registry``).

Functions of a module, not methods: Serve ships an ingress class by value, and a module
it names travels by name, so both ingresses (ours, deploy/ray_serve/app.py, and Serve
LLM's, deploy/ray_serve/llm_app.py) reach the same routers through it.
"""

from __future__ import annotations

from fastapi.responses import FileResponse, JSONResponse, Response

from deploy.ray_serve import registry
from router.http.dashboard import STATIC

NOT_YET = {"error": "no prefix-router decision here yet"}


async def stats(deployment: str) -> Response:
    """The router of ``deployment``'s handle, as the gateway's ``/stats`` (404 before
    its first decision, or under another router)."""
    router = registry.LIVE_ROUTERS.get(deployment)
    if router is None or router.gateway is None:
        return JSONResponse(NOT_YET, 404)
    return JSONResponse(await router.stats())


def dashboard() -> Response:
    """The gateway's dashboard page (its data: :func:`dashboard_data`)."""
    return FileResponse(STATIC / "index.html", headers={"cache-control": "no-cache"})


async def dashboard_data(deployment: str, since: float, show_text: bool) -> Response:
    """One refresh of the dashboard, drawn from the router of ``deployment``'s handle."""
    router = registry.LIVE_ROUTERS.get(deployment)
    if router is None or router.gateway is None:
        return JSONResponse(NOT_YET, 404)
    view = await router.dashboard_view(since, show_text)
    return JSONResponse(view, headers={"cache-control": "no-store"})
