"""Ray Serve LLM's own vLLM replicas, routed by prefix-router's request router.

Ray Serve LLM runs vLLM inside each ``LLMServer`` replica: no server of its own, no
URL, and its KV events off unless the deployment's router is Serve LLM's KV-aware one
(which needs NVIDIA Dynamo and Serve LLM's HAProxy ingress). :class:`PrefixLLMServer`
is that replica, made readable to our router as a vLLM server is to our gateway:

- it turns on vLLM's KV events, on ports of its own (replicas on one node share
  ``engine_kwargs``, so the ports cannot be in them);
- it serves vLLM's own OpenAI app (``/metrics``, ``/v1/models``, ``/v1/completions``)
  on a port of its own, in the replica's process, where the router reads its card and
  load and sends its join check, as it does for any vLLM server (the engine's metrics
  are therefore vLLM's own, on that ``/metrics``, not Ray's: ``log_engine_metrics`` off);
- it says both in ``record_replica_metadata``;
- that server answers only the fleet's token, as our replicas do (none set: anyone).

Requests still travel as Serve LLM sends them: ingress, handle (whose request router
is ours), ``LLMServer.chat``. Use it as Serve LLM's ``server_cls``::

    LLMConfig(model_loading_config=..., server_cls=PrefixLLMServer,
              deployment_config={"request_router_config": prefix_router_config()})
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import ray
from ray.llm._internal.serve.core.server.llm_server import LLMServer
from ray.serve.config import RequestRouterConfig

from deploy.processes import free_port
from deploy.ray_serve import directory
from deploy.ray_serve.config import ROUTERS
from deploy.serving import listening_socket, serve_in_loop
from replica.api.fleet_token import FleetTokenGuard
from replica.vllm_server import KV_TOPIC, OWNER_FILE, WORK_PREFIX, remove_orphaned_folders


def prefix_router_config(**router_kwargs: Any) -> RequestRouterConfig:
    """The deployment option that puts our request router in front of the replicas
    (``router_kwargs``: :class:`~deploy.ray_serve.request_router.PrefixRequestRouter`'s)."""
    return RequestRouterConfig(
        request_router_class=ROUTERS["prefix"],  # type: ignore[arg-type]
        request_router_kwargs=router_kwargs,
    )


class PrefixLLMServer(LLMServer):
    """Serve LLM's ``LLMServer``, its vLLM engine's KV events published and its own
    OpenAI server listening, both where ``record_replica_metadata`` says."""

    async def __init__(self, llm_config: Any, **kwargs: Any) -> None:  # type: ignore[misc]
        self._workdir = _work_folder()
        self._host = ray.util.get_node_ip_address()
        events, replay = free_port(self._host), free_port(self._host)
        self._kv_events = {
            "endpoint": f"tcp://{self._host}:{events}",
            "replay_endpoint": f"tcp://{self._host}:{replay}",
            "topic": KV_TOPIC,
        }
        llm_config.update_engine_kwargs(
            kv_events_config={
                "enable_kv_cache_events": True,
                "publisher": "zmq",
                # vLLM binds its PUB socket to a wildcard only (replica/vllm_server.py)
                "endpoint": f"tcp://*:{events}",
                "replay_endpoint": self._kv_events["replay_endpoint"],
                "topic": KV_TOPIC,
            },
            # vLLM's /metrics (its load, its cache's size) counts only with stats on
            disable_log_stats=False,
        )
        # ... and in this process's Prometheus registry, which its /metrics serves, not
        # in Ray's metrics (Serve LLM's default), which the router cannot read per replica
        llm_config.log_engine_metrics = False
        await super().__init__(llm_config, **kwargs)
        assert self.engine is not None  # started
        # guarded as our replicas are: only the fleet's token passes (none set: all do)
        app = FleetTokenGuard(await self.engine.build_asgi_app())
        sock = listening_socket(self._host, 0)
        port = sock.getsockname()[1]
        self._http, _ = await serve_in_loop(app, self._host, port, sock, lifespan="off")
        self._url = f"http://{self._host}:{port}"

    async def record_replica_metadata(self) -> dict[str, Any]:
        """Said once, when the replica is ready: where its vLLM server answers and where
        its engine publishes KV events (the request router follows both). The URL also
        goes in the application's directory, where the ingress's ``/engines`` lists it."""
        directory.enter(self._url)
        return {"url": self._url, "kv_events": self._kv_events}

    async def __del__(self) -> None:
        with contextlib.suppress(Exception):
            directory.leave()
            self._http.stop()
        await super().__del__()
        shutil.rmtree(self._workdir, ignore_errors=True)


def _work_folder() -> Path:
    """A folder for the engine's IPC sockets (vLLM leaves them in the temporary
    directory), removed when the replica stops, or by the next vLLM server started on
    the machine if its process was killed (``remove_orphaned_folders``)."""
    remove_orphaned_folders()
    folder = Path(tempfile.mkdtemp(prefix=WORK_PREFIX))
    (folder / OWNER_FILE).write_text(str(os.getpid()))
    os.environ["VLLM_RPC_BASE_PATH"] = str(folder)  # the replica's process is its own
    return folder
