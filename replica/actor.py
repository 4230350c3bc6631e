"""A replica as a Ray actor: the HTTP server runs inside the actor's event loop.

Ray places the actor, restarts it when it dies (``max_restarts``) and lets the
gateway find it by name; requests never pass through Ray, only HTTP. The server
starts on first use (``url()``), also after a restart, on a free port of the node's
address, and the actor reports that URL.
"""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import ray

from deploy.serving import Server, serve_in_loop
from replica.api.config import ReplicaConfig
from replica.server import create_app


def free_port(host: str) -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


class ReplicaServer:
    """The actor's body, kept a plain class so it can be read and tested without Ray."""

    def __init__(self, config: ReplicaConfig, host: str | None = None) -> None:
        self.config = config
        self.host = host
        self._url: str | None = None
        self._server: Server | None = None
        self._task: asyncio.Task[None] | None = None
        self._starting = asyncio.Lock()

    async def url(self) -> str:
        """Start the server if it is not running, and return its base URL."""
        async with self._starting:
            if self._url is None:
                host = self.host or ray.util.get_node_ip_address()
                port = free_port(host)
                app = create_app(self.config, kv_events_host=host)
                self._server, self._task = await serve_in_loop(app, host, port)
                self._url = f"http://{host}:{port}"
            return self._url

    async def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    async def stop(self) -> None:
        if self._server is not None and self._task is not None:
            self._server.stop()
            await self._task
        self._url = self._server = self._task = None


ReplicaActor: Any = ray.remote(max_restarts=-1, max_task_retries=0)(ReplicaServer)
