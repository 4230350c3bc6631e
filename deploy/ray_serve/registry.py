"""The request routers of this process, by the name of the deployment they route to.

A module of its own because Ray Serve ships a request router's class and an ingress's
class by value, each with copies of the globals its module names; a module is sent by
name, so both reach the one dict of the process they run in through it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from deploy.ray_serve.request_router import PrefixRequestRouter

#: What the ingress's ``/stats`` shows: the router of its handle to the engines.
LIVE_ROUTERS: dict[str, PrefixRequestRouter] = {}
