"""The gateway's replicas: where they are, their load, and their KV events.

A backend is any OpenAI-compatible server (ours, vLLM, SGLang) known by URL. The
pool keeps one :class:`~router.policies.ReplicaState` per backend for the policy,
one pooled ``aiohttp.ClientSession`` for all traffic, and a task per backend that
follows its KV events: pushed on ZMQ in vLLM's format when the backend publishes
them (ours say where in ``/stats``; a vLLM server's endpoint is given when it is
added), else polled at ``/kv_events``, else none (only ``/health`` is probed).
Backends can be added and removed while the gateway serves.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from replica.api import stats as stats_codec
from replica.api.kv_events import KVEvent, KVEventPage, decode_page
from replica.api.stats import KVEventsEndpoint, ReplicaStats
from router import load
from router.kv_subscriber import KVStreams, StreamState
from router.policies import ReplicaState

log = logging.getLogger(__name__)


def parse_backend(spec: str) -> tuple[str, KVEventsEndpoint | None]:
    """``URL``, or ``URL,kv=tcp://HOST:PORT[,replay=tcp://HOST:PORT][,topic=TOPIC]`` for
    an engine that publishes its KV events on ZMQ without saying where (vLLM started
    with ``--kv-events-config``: its ``endpoint``, ``replay_endpoint`` and ``topic``)."""
    url, *options = spec.split(",")
    fields: dict[str, str] = {}
    for option in options:
        name, _, value = option.partition("=")
        if name not in ("kv", "replay", "topic") or not value:
            raise ValueError(f"backend {spec!r}: expected kv=, replay= or topic=, got {option!r}")
        fields[name] = value
    if not fields:
        return url, None
    if "kv" not in fields:
        raise ValueError(f"backend {spec!r}: replay= and topic= need kv=tcp://HOST:PORT")
    endpoint = KVEventsEndpoint(fields["kv"], fields.get("replay", ""), fields.get("topic", ""))
    return url, endpoint


@dataclass(eq=False)
class Backend:
    url: str
    state: ReplicaState
    last_event_seq: int = 0
    events_supported: bool = True
    #: Its KV events pushed on ZMQ (given, or found in its ``/stats``), and the last
    #: load it reported there.
    kv_endpoint: KVEventsEndpoint | None = None
    stream: StreamState | None = field(default=None, repr=False)
    #: Circuit breaker: an unhealthy backend gets no requests until a probe succeeds.
    healthy: bool = True
    failed_probes: int = 0
    _poller: asyncio.Task[None] | None = field(default=None, repr=False)
    _probe_now: asyncio.Event = field(default_factory=asyncio.Event, repr=False)


class BackendPool:
    """Backends by URL. ``on_events`` receives each backend's new KV events."""

    def __init__(
        self,
        client: aiohttp.ClientSession,
        on_events: Callable[[ReplicaState, list[KVEvent]], None],
        on_added: Callable[[ReplicaState], None],
        on_removed: Callable[[ReplicaState], None],
        poll_interval_s: float = 0.05,
        default_capacity_blocks: int = 4096,
        health_interval_s: float = 0.5,
        failure_threshold: int = 2,
    ) -> None:
        self.client = client
        self._on_events = on_events
        self._on_added = on_added
        self._on_removed = on_removed
        self._interval = poll_interval_s
        self._capacity = default_capacity_blocks
        self._health_interval = health_interval_s
        self._failure_threshold = failure_threshold
        self._backends: dict[str, Backend] = {}
        self._streams: KVStreams | None = None  # the thread following pushed events, if any

    @property
    def backends(self) -> list[Backend]:
        return list(self._backends.values())

    @property
    def states(self) -> list[ReplicaState]:
        """The backends to route to: those whose circuit is closed."""
        return [b.state for b in self._backends.values() if b.healthy]

    def open_circuit(self, backend: Backend) -> None:
        """Stop routing to ``backend`` at once and forget what its cache held; probes
        of its ``/health`` re-admit it, with an empty index."""
        if backend.healthy and backend.state.replica_id in self._backends:
            backend.healthy = False
            backend._probe_now.set()  # start probing its health now, not after a poll interval
            self._on_removed(backend.state)
            log.warning("backend %s is down: no more requests until it is healthy", backend.url)

    def _readmit(self, backend: Backend) -> None:
        backend.healthy, backend.failed_probes = True, 0
        backend.last_event_seq, backend.events_supported = 0, True  # it may have restarted
        if backend.stream is not None and self._streams is not None:
            self._streams.relearn(backend)  # learn its cache again from the replay buffer
        self._on_added(backend.state)
        log.warning("backend %s is healthy again", backend.url)

    def by_state(self, state: ReplicaState) -> Backend:
        return self._backends[state.replica_id]

    def add(
        self,
        url: str,
        replica_id: str | None = None,
        capacity_blocks: int | None = None,
        kv_endpoint: KVEventsEndpoint | None = None,
    ) -> Backend:
        """Start routing to ``url`` (idempotent); its KV events are followed from now on
        (``kv_endpoint``: where a vLLM server publishes them)."""
        url = url.rstrip("/")
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"backend URL must start with http:// or https://, got {url!r}")
        for backend in self._backends.values():
            if backend.url == url:
                return backend
        name = replica_id or url
        state = ReplicaState(name, capacity_blocks or self._capacity)
        backend = Backend(url, state, kv_endpoint=kv_endpoint)
        self._backends[name] = backend
        self._on_added(backend.state)
        backend._poller = asyncio.get_running_loop().create_task(self._watch(backend))
        return backend

    async def remove(self, url_or_id: str) -> bool:
        key = url_or_id.rstrip("/")
        backend = self._backends.get(key) or next(
            (b for b in self._backends.values() if b.url == key), None
        )
        if backend is None:
            return False
        del self._backends[backend.state.replica_id]
        if backend._poller is not None:
            backend._poller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await backend._poller
        if backend.stream is not None and self._streams is not None:
            self._streams.forget(backend)
        if backend.healthy:  # an open circuit has already removed it from the policy
            self._on_removed(backend.state)
        return True

    async def close(self) -> None:
        for backend in list(self._backends.values()):
            await self.remove(backend.state.replica_id)
        if self._streams is not None:
            await asyncio.to_thread(self._streams.close)

    async def _watch(self, backend: Backend) -> None:
        """Follow the backend for ever: subscribe to its pushed KV events if it has any,
        then probe it (see :meth:`_probe`)."""
        endpoint = backend.kv_endpoint or await self._discover(backend)
        if endpoint is None:
            await self._probe_forever(backend)
            return
        backend.kv_endpoint = endpoint
        backend.stream = self._kv_streams().follow(
            backend,
            endpoint,
            on_events=lambda events: self._on_events(backend.state, events),
            on_load=lambda report: load.reported(backend.state, report),
        )
        await self._probe_forever(backend)

    def _kv_streams(self) -> KVStreams:
        if self._streams is None:
            self._streams = KVStreams(asyncio.get_running_loop().call_soon_threadsafe)
        return self._streams

    async def _discover(self, backend: Backend) -> KVEventsEndpoint | None:
        """Where one of our replicas pushes its events (its ``/stats`` says)."""
        try:
            async with self.client.get(
                f"{backend.url}/stats", timeout=aiohttp.ClientTimeout(total=5.0)
            ) as response:
                if response.status != 200:
                    return None
                return stats_codec.decode(ReplicaStats, await response.read()).kv_events
        except (aiohttp.ClientError, TimeoutError, ValueError):
            return None  # not one of ours, or not up yet: polled or probed instead

    async def _probe_forever(self, backend: Backend) -> None:
        """Open the backend's circuit after ``failure_threshold`` failed probes in a
        row, close it after one good probe. A backend whose stream has a heartbeat (ours)
        is alive while it beats; otherwise its ``/kv_events`` is polled every 50 ms (ours
        without a push) or its ``/health`` probed (vLLM and SGLang, whose event streams
        are quiet whenever their caches are, or a silent stream)."""
        while True:
            healthy = await self._probe(backend)
            if healthy:
                backend.failed_probes = 0
                if not backend.healthy:
                    self._readmit(backend)
            else:
                backend.failed_probes += 1
                if backend.failed_probes >= self._failure_threshold:
                    self.open_circuit(backend)
            following = backend.healthy and backend.events_supported and not backend.stream
            with contextlib.suppress(TimeoutError):
                interval = self._interval if following else self._health_interval
                await asyncio.wait_for(backend._probe_now.wait(), interval)
            backend._probe_now.clear()

    async def _probe(self, backend: Backend) -> bool:
        stream = backend.stream
        beating = stream is not None and stream.endpoint.load_endpoint and not stream.stale
        if beating and backend.healthy:
            return True  # its stream has a heartbeat: it speaks at least every 50 ms
        if stream is None and backend.healthy and backend.events_supported:
            return await self._follow_events(backend)
        try:
            async with self.client.get(
                f"{backend.url}/health", timeout=aiohttp.ClientTimeout(total=2.0)
            ) as response:
                return response.status == 200
        except (aiohttp.ClientError, TimeoutError):
            return False

    async def _follow_events(self, backend: Backend) -> bool:
        """Hand the backend's new KV events to the policy; False if it did not answer."""
        try:
            page = await self._events_after(backend)
        except (aiohttp.ClientError, TimeoutError) as error:
            log.debug("kv events from %s: %r", backend.url, error)
            return False
        except ValueError as error:  # answered, but not a page of events
            log.debug("kv events from %s: %r", backend.url, error)
            return True
        if page is None:  # no KV events here (vLLM, SGLang): probe /health instead
            backend.events_supported = False
            return True
        events = list(page.events)
        if page.lost:  # fell behind the replica's log: start over empty
            events.insert(0, KVEvent(0, "cleared"))
        if events:
            self._on_events(backend.state, events)
        backend.last_event_seq = page.last_seq
        return True

    async def _events_after(self, backend: Backend) -> KVEventPage | None:
        """The backend's ``/kv_events`` page, or ``None`` if it has no such endpoint."""
        async with self.client.get(
            f"{backend.url}/kv_events",
            params={"since": backend.last_event_seq},
            timeout=aiohttp.ClientTimeout(total=5.0),
        ) as response:
            if response.status == 404:
                return None
            response.raise_for_status()
            return decode_page(await response.read())


async def follow_ray_replicas(pool: BackendPool, prefix: str, interval_s: float = 1.0) -> None:
    """Keep the pool equal to the live replica actors named ``prefix*`` in this namespace.

    Every round asks each actor for its URL (which starts its server if needed): a
    new actor is added, one that Ray restarted on another port is re-added with an
    empty index, and one that is gone or not answering is removed until it answers
    again. Ray's look-ups block, so they run in a thread; actor calls are awaited.
    """
    import ray

    while True:
        try:
            names = await asyncio.to_thread(ray.util.list_named_actors)
            wanted = sorted(name for name in names if name.startswith(prefix))
            urls = await asyncio.gather(*(_actor_url(ray, name) for name in wanted))
            live = {name: url for name, url in zip(wanted, urls, strict=True) if url}
            for backend in pool.backends:
                name = backend.state.replica_id
                if live.get(name) != backend.url:
                    await pool.remove(name)
            for name, url in live.items():
                pool.add(url, replica_id=name)
        except Exception as error:  # Ray busy or restarting: try again next round
            log.warning("following Ray replicas: %r", error)
        await asyncio.sleep(interval_s)


async def _actor_url(ray: Any, name: str, timeout_s: float = 10.0) -> str | None:
    try:
        handle = await asyncio.to_thread(ray.get_actor, name)
        url: str = await asyncio.wait_for(handle.url.remote(), timeout=timeout_s)
        return url
    except Exception:  # dead, restarting, or removed since the listing
        return None
