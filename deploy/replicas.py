"""Replicas as Ray actors: our simulated engine's server inside the actor, or a vLLM
server process the actor owns.

Ray places an actor, restarts it when it dies (``max_restarts``) and lets the gateways
find it by name; requests never pass through Ray, only HTTP. Either kind answers the
same calls: ``url()`` starts its server on first use (also after a restart) and returns
its base URL; ``card()`` returns its :class:`~replica.api.card.EngineCard` (URL, model,
block size, pool, tokenizer, where it publishes its KV events), from which every
gateway configures itself; ``stop()`` stops it and cleans up. Given the fleet's token,
its server answers only requests that carry it (replica/api/fleet_token.py).

Why vLLM runs as a process the actor owns, not embedded as Ray Serve LLM embeds its
engine: vLLM's server is what its users run and tune (every flag passes through as
vLLM names it), its ``run_server`` must own the main thread of a process (it installs
signal handlers, which fails inside an async Ray actor), and a crash of the engine
(an out-of-memory kill, a CUDA fault) then leaves the actor alive to say so, restart the
server on the same ports and keep its name, so gateways re-admit it by its health.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import httpx
import ray

from deploy.processes import free_port
from deploy.serving import Server, listening_socket, serve_in_loop
from replica.api.card import EngineCard, sim_card
from replica.api.config import ReplicaConfig
from replica.api.figures import vllm_requests_in_engine
from replica.api.fleet_token import bearer
from replica.server import create_app
from replica.vllm_server import Ports, VLLMConfig, VLLMServer
from router.fleet.autoscaler import FleetLoad

log = logging.getLogger(__name__)

#: A replica's engine: our simulated one (its config) or vLLM (its model and flags).
EngineSpec = ReplicaConfig | VLLMConfig


class SimReplica:
    """A simulated engine's HTTP server in the actor's event loop (the body of the actor;
    a plain class, readable and testable without Ray)."""

    def __init__(
        self, config: ReplicaConfig, host: str | None = None, fleet_token: str = ""
    ) -> None:
        self.config = config
        self.host = host
        self.fleet_token = fleet_token
        self._url: str | None = None
        self._app: Any = None
        self._server: Server | None = None
        self._task: asyncio.Task[None] | None = None
        self._starting = asyncio.Lock()
        self.draining = False

    async def url(self) -> str:
        """Start the server if it is not running, and return its base URL."""
        async with self._starting:
            if self._url is None:
                host = self.host or ray.util.get_node_ip_address()
                sock = listening_socket(host, 0)  # held from now: no other can take it
                port = int(sock.getsockname()[1])
                self._app = create_app(self.config, host, self.fleet_token)
                self._server, self._task = await serve_in_loop(self._app, host, port, sock)
                self._url = f"http://{host}:{port}"
            return self._url

    async def card(self) -> EngineCard:
        url = await self.url()
        return replace(sim_card(url, self._app.state.replica.stats()), draining=self.draining)

    async def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    async def drain(self) -> None:
        """Leave the fleet: gateways see it in the card and send nothing new."""
        self.draining = True

    async def load(self) -> FleetLoad:
        """Requests it runs or queues, and prompt tokens waiting for prefill."""
        await self.url()
        engines = self._app.state.ranks.all  # a data-parallel server's, summed
        queued = sum(replica.engine.queued_prefill_tokens for replica in engines)
        return FleetLoad(sum(replica.load for replica in engines), queued)

    async def stop(self) -> None:
        if self._server is not None and self._task is not None:
            self._server.stop()
            await self._task
        self._url = self._server = self._task = None


class VLLMReplica:
    """A vLLM server process owned by the actor: started on first use, restarted on the
    same ports when it dies (watched every ``watch_s``), stopped with :meth:`stop`."""

    def __init__(
        self,
        config: VLLMConfig,
        host: str | None = None,
        fleet_token: str = "",
        watch_s: float = 1.0,
    ) -> None:
        self.config = config
        self.host = host
        self.fleet_token = fleet_token
        self.watch_s = watch_s
        self.restarts = 0
        self.draining = False
        self._server: VLLMServer | None = None
        self._starting = asyncio.Lock()
        self._watcher: asyncio.Task[None] | None = None

    async def url(self) -> str:
        """Start the server if it is not running (wait until it serves), and return its URL."""
        async with self._starting:
            server = self._server
            if server is None:
                host = self.host or ray.util.get_node_ip_address()
                ports = Ports(free_port(host), free_port(host), free_port(host))
                server = self._server = VLLMServer(self.config, host, ports, self.fleet_token)
            if not server.alive():
                server.launch()  # from the event loop's thread, which lives as long as we do
                await asyncio.to_thread(server.wait_ready)
            if self._watcher is None:
                self._watcher = asyncio.get_running_loop().create_task(self._watch())
            return server.url

    async def card(self) -> EngineCard:
        await self.url()
        assert self._server is not None
        card = await asyncio.to_thread(self._server.card)
        return replace(card, draining=self.draining)

    async def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    async def drain(self) -> None:
        """Leave the fleet: gateways see it in the card and send nothing new."""
        self.draining = True

    async def load(self) -> FleetLoad:
        """Requests it runs or queues, from vLLM's ``/metrics`` (its queued prefill
        tokens it does not say)."""
        url = await self.url()
        headers = bearer(self.fleet_token)
        text = await asyncio.to_thread(
            lambda: httpx.get(f"{url}/metrics", headers=headers, timeout=5).text
        )
        return FleetLoad(vllm_requests_in_engine(text), 0)

    async def stop(self) -> None:
        if self._watcher is not None:
            self._watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watcher
            self._watcher = None
        async with self._starting:
            if self._server is not None:
                await asyncio.to_thread(self._server.stop)

    async def _watch(self) -> None:
        """Restart the server whenever its process has died."""
        while True:
            await asyncio.sleep(self.watch_s)
            server = self._server
            if server is None or server.alive() or self._starting.locked():
                continue
            code = server.process.returncode if server.process else None
            log.warning("vLLM server %s exited with %s: restarting it", server.url, code)
            self.restarts += 1
            try:
                await self.url()
            except (RuntimeError, TimeoutError) as error:
                log.error("vLLM server %s did not restart: %s", server.url, error)


SimReplicaActor: Any = ray.remote(max_restarts=-1, max_task_retries=0)(SimReplica)
VLLMReplicaActor: Any = ray.remote(max_restarts=-1, max_task_retries=0)(VLLMReplica)


class ReplicaStartError(RuntimeError):
    """A replica's engine did not start (the message quotes why: its log's last lines)."""


def ready_cards(handles: Sequence[Any], timeout_s: float | None = None) -> list[EngineCard]:
    """Start every replica (all at once) and return their cards once they serve; raises
    :class:`ReplicaStartError` with the first failure's reason."""
    try:
        return list(ray.get([handle.card.remote() for handle in handles], timeout=timeout_s))
    except ray.exceptions.RayTaskError as error:
        raise ReplicaStartError(f"a replica did not start: {error.cause}") from None


def stop_replicas(handles: Sequence[Any], timeout_s: float = 30.0) -> None:
    """Stop the replicas' servers (a vLLM process and its files), then kill the actors."""
    with contextlib.suppress(ray.exceptions.RayError, TimeoutError):
        ray.get([handle.stop.remote() for handle in handles], timeout=timeout_s)
    for handle in handles:
        with contextlib.suppress(ray.exceptions.RayError):
            ray.kill(handle, no_restart=True)
