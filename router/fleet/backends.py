"""The gateway's replicas: where they are, their load, and their KV events.

A backend is any OpenAI-compatible server (ours, vLLM, SGLang) known by URL. The
pool keeps one :class:`~router.policies.ReplicaState` per backend for the policy,
one pooled ``aiohttp.ClientSession`` for all traffic, and a task per backend that
learns what the backend is (its :class:`~replica.api.card.EngineCard`: given by its
Ray actor, else read from our ``/stats`` or vLLM's ``/metrics``), follows its KV
events (pushed on ZMQ in vLLM's format: where, its card says, or the flag that added
it; else polled at ``/kv_events``; else none, and only ``/health`` is probed), and
checks that the backend caches as the router hashes (``router/fleet/backend_check.py``):
until the check fails, its events are trusted; after, it is routed approximately.
Backends can be added and removed while the gateway serves.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple

import aiohttp

from replica.api.card import EngineCard
from replica.api.config import ROLES
from replica.api.engines import ENGINES
from replica.api.kv_events import KVEvent, KVEventPage, decode_page
from replica.api.stats import KVEventsEndpoint, LoadReport
from router.core import ReplicaState
from router.fleet import load
from router.fleet.backend_check import (
    BackendCheck,
    CanaryWatch,
    NotOfItsFleet,
    Verdict,
    check_credential,
)
from router.fleet.data_parallel import rank_endpoint, rank_name
from router.fleet.vllm_load import vllm_load
from router.index.kv_subscriber import FollowedStream, KVStreams, StreamState

#: How the router knows a backend's cache: from its events once they are checked
#: (``checking``: approximately, until its check passes), or from its own decisions
#: (``approximate``).
RoutingMode = Literal["checking", "precise", "approximate"]
NOT_CHECKED = ("every check (--no-check-backends)",)
#: An interrupted join check is tried again after this, doubling up to the most.
CHECK_RETRY_S = 1.0
CHECK_RETRY_MAX_S = 30.0

log = logging.getLogger(__name__)


class BackendSpec(NamedTuple):
    """A ``--backend`` as given: its URL, where it publishes KV events, its role."""

    url: str
    kv_endpoint: KVEventsEndpoint | None = None
    role: str | None = None


def parse_backend(spec: str) -> BackendSpec:
    """``URL``, or ``URL,kv=tcp://HOST:PORT[,replay=tcp://HOST:PORT][,topic=TOPIC]`` for
    an engine that publishes its KV events on ZMQ without saying where (vLLM started
    with ``--kv-events-config``: its ``endpoint``, ``replay_endpoint`` and ``topic``),
    and ``,role=prefill`` or ``,role=decode`` for one that does not say its role (a
    vLLM server of a disaggregated fleet)."""
    url, *options = spec.split(",")
    _check_url(spec, url)
    fields: dict[str, str] = {}
    for option in options:
        name, _, value = option.partition("=")
        if name not in ("kv", "replay", "topic", "role") or not value:
            raise ValueError(
                f"backend {spec!r}: expected kv=, replay=, topic= or role=, got {option!r}"
            )
        fields[name] = value
    role = fields.pop("role", None)
    if role is not None and role not in ROLES:
        raise ValueError(f"backend {spec!r}: role= takes {', '.join(ROLES)}, got {role!r}")
    if not fields:
        return BackendSpec(url, None, role)
    if "kv" not in fields:
        raise ValueError(f"backend {spec!r}: replay= and topic= need kv=tcp://HOST:PORT")
    endpoint = KVEventsEndpoint(fields["kv"], fields.get("replay", ""), fields.get("topic", ""))
    return BackendSpec(url, endpoint, role)


def _check_url(spec: str, url: str) -> None:
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https"):
        raise ValueError(
            f"backend {spec!r}: its URL needs http:// or https:// "
            f"(say http://{url.split('://')[-1]})"
        )
    try:
        parts.port  # noqa: B018 (parses it: a port that is no number raises)
    except ValueError:
        raise ValueError(f"backend {spec!r}: its port is not a number") from None
    if not parts.hostname:
        raise ValueError(f"backend {spec!r}: expected http://HOST:PORT")


@dataclass(eq=False)
class Backend:
    url: str
    state: ReplicaState
    #: One engine of a data-parallel server (router/fleet/data_parallel.py): its rank,
    #: which every request sent to it names, and the server's own name, which its ranks
    #: share (``None``, ``""``: a server of one engine, named as its replica).
    dp_rank: int | None = None
    server: str = ""
    last_event_seq: int = 0
    events_supported: bool = True
    #: Its KV events pushed on ZMQ (given, or found in its ``/stats``), and the last
    #: load it reported there.
    kv_endpoint: KVEventsEndpoint | None = None
    stream: StreamState | None = field(default=None, repr=False)
    #: Circuit breaker: an unhealthy backend gets no requests until a probe succeeds.
    healthy: bool = True
    failed_probes: int = 0
    #: What it says of itself, once known, and when it was last asked.
    card: EngineCard | None = None
    described_at: float = 0.0
    #: Routed to: it said what it serves (or was asked and did not say).
    joined: bool = False
    #: Leaving the fleet, as its card says: sent nothing new, its requests end there.
    draining: bool = False
    #: Its role as the operator gave it (``--backend URL,role=...``), over its card's.
    given_role: str | None = None
    routing_mode: RoutingMode = "checking"
    #: Why it is routed approximately (what differs, and the flag that fixes it).
    approximate_reason: str | None = None
    #: Checks that could not be made when it joined, and why.
    unchecked: tuple[str, ...] = ()
    #: Stored blocks of its events the policy could not key.
    unkeyed_blocks: int = 0
    #: While its join check runs: what its events key to.
    canary: CanaryWatch | None = field(default=None, repr=False)
    _poller: asyncio.Task[None] | None = field(default=None, repr=False)
    _checker: asyncio.Task[None] | None = field(default=None, repr=False)
    _probe_now: asyncio.Event = field(default_factory=asyncio.Event, repr=False)

    @property
    def label(self) -> str:
        """How logs name it: its URL, and its rank if it is one engine of several."""
        return self.url if self.dp_rank is None else f"{self.url} (rank {self.dp_rank})"


class BackendPool:
    """Backends by URL. ``on_events`` receives each backend's new KV events and returns
    how many stored blocks it could not key; ``on_report`` is told each new load
    report, after it is counted; ``check`` (if any) checks each joining backend."""

    def __init__(
        self,
        client: aiohttp.ClientSession,
        on_events: Callable[[ReplicaState, list[KVEvent]], int],
        on_added: Callable[[ReplicaState], None],
        on_removed: Callable[[ReplicaState], None],
        poll_interval_s: float = 0.05,
        default_capacity_blocks: int = 4096,
        health_interval_s: float = 0.5,
        failure_threshold: int = 2,
        check: BackendCheck | None = None,
        describe_interval_s: float = 10.0,
        on_report: Callable[[ReplicaState], None] | None = None,
    ) -> None:
        self.client = client
        self.check = check
        self._on_events = on_events
        self._on_report = on_report
        self._on_added = on_added
        self._on_removed = on_removed
        self._interval = poll_interval_s
        self._capacity = default_capacity_blocks
        self._health_interval = health_interval_s
        self._failure_threshold = failure_threshold
        self._describe_interval = describe_interval_s
        self._backends: dict[str, Backend] = {}
        #: The longest request any backend serves, as the cards say (``None``: none says).
        self.max_model_len: int | None = None
        self._streams: KVStreams | None = None  # the thread following pushed events, if any

    @property
    def backends(self) -> list[Backend]:
        return list(self._backends.values())

    @property
    def states(self) -> list[ReplicaState]:
        """The backends to route to: those that joined, whose circuit is closed and
        that are not leaving the fleet (a draining one stays in the policy's index and
        load until it goes, so its requests end as counted)."""
        return [
            b.state for b in self._backends.values() if b.healthy and b.joined and not b.draining
        ]

    def open_circuit(self, backend: Backend) -> None:
        """Stop routing to ``backend`` at once and forget what its cache held; probes
        of its ``/health`` re-admit it, with an empty index."""
        if backend.healthy and backend.state.replica_id in self._backends:
            backend.healthy = False
            backend._probe_now.set()  # start probing its health now, not after a poll interval
            self._on_removed(backend.state)
            log.warning("backend %s is down: no more requests until it is healthy", backend.label)

    def _readmit(self, backend: Backend) -> None:
        backend.healthy, backend.failed_probes = True, 0
        backend.last_event_seq, backend.events_supported = 0, True  # it may have restarted
        if backend.stream is not None and self._streams is not None:
            self._streams.relearn(backend)  # learn its cache again from the replay buffer
        self._on_added(backend.state)
        log.warning("backend %s is healthy again", backend.label)
        self._start_check(backend)  # it may have come back as another engine

    def _engine_restarted(self, backend: Backend) -> None:
        """A new engine behind the backend's sockets (its stream dropped its entries):
        it may serve another model or key otherwise, so it is described and checked
        again, as a new backend, routed approximately until its check passes."""
        log.warning("backend %s: a new engine (its KV events started over)", backend.label)
        asyncio.get_running_loop().create_task(self._describe_again(backend))
        self._start_check(backend)

    def _events(self, backend: Backend, events: list[KVEvent]) -> None:
        if backend.canary is not None:
            backend.canary.feed(events)
        backend.unkeyed_blocks += self._on_events(backend.state, events)

    def by_state(self, state: ReplicaState) -> Backend:
        return self._backends[state.replica_id]

    def add(
        self,
        url: str,
        replica_id: str | None = None,
        capacity_blocks: int | None = None,
        kv_endpoint: KVEventsEndpoint | None = None,
        card: EngineCard | None = None,
        role: str | None = None,
        dp_rank: int | None = None,
    ) -> Backend:
        """Start routing to ``url`` (idempotent); its KV events are followed from now on
        (``kv_endpoint``: where a vLLM server publishes them; ``card``: what it is, as
        its Ray actor says)."""
        url = url.rstrip("/")
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"backend URL must start with http:// or https://, got {url!r}")
        known = [b for b in self._backends.values() if b.url == url]
        if known and (dp_rank is None or any(b.dp_rank == dp_rank for b in known)):
            if card is not None:  # told again (Ray's discovery): adapters may have changed
                for backend in known:
                    self._learn(backend, card)
            return next((b for b in known if b.dp_rank == dp_rank), known[0])
        server = replica_id or url
        name = server if dp_rank is None else rank_name(server, dp_rank)
        capacity = capacity_blocks or (card.num_blocks if card else None) or self._capacity
        state = ReplicaState(name, capacity, precise=self.check is None)  # trusted once checked
        kv_endpoint = kv_endpoint or (card.kv_events if card else None)
        backend = Backend(url, state, dp_rank, server, kv_endpoint=kv_endpoint, given_role=role)
        state.role = role or state.role
        self._backends[name] = backend
        if card is not None:  # what it serves is known: route to it at once
            self._learn(backend, card)
            self._join(backend)
        backend._poller = asyncio.get_running_loop().create_task(self._watch(backend))
        return backend

    def _split_ranks(self, backend: Backend) -> None:
        """A server whose card says it has several data-parallel engines: it becomes
        rank 0, and a backend is added for each other rank, its events followed where
        vLLM publishes them (router/fleet/data_parallel.py). One already routed to (it
        said so only once up) is routed again under its rank's name and checked again,
        as rank 0 (its cache learnt again from its replay socket once it passes)."""
        card = backend.card
        if card is None or card.data_parallel_size < 2 or backend.dp_rank is not None:
            return
        routed = backend.joined and backend.healthy
        if routed:
            self._on_removed(backend.state)
        del self._backends[backend.state.replica_id]
        backend.dp_rank, backend.state.replica_id = 0, rank_name(backend.server, 0)
        self._backends[backend.state.replica_id] = backend
        if routed:
            self._on_added(backend.state)
            if backend._checker is not None:  # its canary went to either engine
                backend._checker.cancel()  # (not done() until it runs: forget it)
                backend._checker = None
            self._start_check(backend)
        endpoint = backend.kv_endpoint or card.kv_events
        for rank in range(1, card.data_parallel_size):
            self.add(
                backend.url,
                replica_id=backend.server,
                kv_endpoint=rank_endpoint(endpoint, rank) if endpoint else None,
                card=card,
                role=backend.given_role,
                dp_rank=rank,
            )

    def _learn(self, backend: Backend, card: EngineCard) -> None:
        """Take what the backend says of itself: the model and adapters it serves."""
        state, routed = backend.state, backend.joined and backend.healthy
        backend.card, backend.described_at = card, time.monotonic()
        if card.draining and not backend.draining:
            log.warning("backend %s is leaving the fleet: no more requests", backend.label)
        backend.draining = card.draining
        if card.num_blocks:
            state.capacity_blocks = card.num_blocks
        state.max_num_seqs = card.max_num_seqs
        model = card.model or None
        if model != state.model and routed:  # another model: it moves to that model's policy
            self._on_removed(state)
            state.model = model
            self._on_added(state)
        state.model, state.adapters = model, frozenset(card.adapters)
        state.role = backend.given_role or card.role
        self._longest_served()
        self._split_ranks(backend)

    def _longest_served(self) -> None:
        lengths = [b.card.max_model_len for b in self._backends.values() if b.card]
        self.max_model_len = max((n for n in lengths if n), default=None)

    def _join(self, backend: Backend) -> None:
        backend.joined = True
        self._on_added(backend.state)

    async def remove(self, url_or_id: str) -> bool:
        """Stop routing to a backend, named by URL or by name (a data-parallel server's
        ranks all, named by its URL or its own name); whether there was one."""
        key = url_or_id.rstrip("/")
        backend = self._backends.get(key)
        if backend is not None:
            await self._remove(backend)
            return True
        servers = [b for b in self.backends if key in (b.url, b.server)]
        for backend in servers:
            await self._remove(backend)
        return bool(servers)

    async def _remove(self, backend: Backend) -> None:
        del self._backends[backend.state.replica_id]
        self._longest_served()
        for task in (backend._poller, backend._checker):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        if backend.stream is not None and self._streams is not None:
            self._streams.forget(backend)
        if backend.healthy:  # an open circuit has already removed it from the policy
            self._on_removed(backend.state)

    async def learned(self, timeout_s: float) -> bool:
        """Wait, at most ``timeout_s``, until every backend has joined and, if it
        publishes KV events, its replay buffer is in the index: a gateway that starts
        beside others (or after a crash) then predicts as they do from its first
        request. Whether they all have."""
        try:
            async with asyncio.timeout(timeout_s):
                while not all(_learned(b) for b in self._backends.values()):
                    await asyncio.sleep(0.01)
        except TimeoutError:
            return False
        return True

    async def close(self) -> None:
        for backend in list(self._backends.values()):
            await self.remove(backend.state.replica_id)
        if self._streams is not None:
            await asyncio.to_thread(self._streams.close)

    async def _watch(self, backend: Backend) -> None:
        """Follow the backend for ever: learn what it is, subscribe to its pushed KV
        events if it has any, check it, then probe it (see :meth:`_probe`)."""
        if not backend.joined:
            card = await describe(self.client, backend.url)
            if card is not None:
                self._learn(backend, card)
            self._join(backend)  # told nothing: it serves the gateway's default model
        endpoint = backend.kv_endpoint or (backend.card.kv_events if backend.card else None)
        if endpoint is not None:
            backend.kv_endpoint = endpoint
            streams = self._kv_streams()
            backend.stream = streams.follow(
                backend,
                endpoint,
                on_events=lambda events: self._events(backend, events),
                on_load=lambda report: self._reported(backend.state, report),
                on_restart=lambda: self._engine_restarted(backend),
            )
            if endpoint.replay_endpoint:  # the policy may have it applied again
                backend.state.kv_stream = FollowedStream(streams, backend, backend.stream)
        self._start_check(backend)
        await self._probe_forever(backend)

    def _start_check(self, backend: Backend) -> None:
        """Check the backend (again: it may have come back as another engine); until
        the check passes, it is routed approximately, its events not believed."""
        if self.check is None:  # its events are trusted as they come
            backend.routing_mode, backend.unchecked = "precise", NOT_CHECKED
            return
        backend.routing_mode = "checking"
        if backend.state.precise:
            self._remodel(backend, precise=False)
        if backend._checker is None or backend._checker.done():
            backend._checker = asyncio.get_running_loop().create_task(self._checked(backend))

    async def _checked(self, backend: Backend) -> None:
        """Run the join check until it gives a verdict, and apply it. An interrupted
        check is tried again while the backend stays healthy (backing off to
        ``CHECK_RETRY_MAX_S``); a backend that went down is checked on its return."""
        assert self.check is not None
        if backend.stream is None and not await self._serves_events(backend):
            verdict = Verdict(
                False,
                "it publishes no KV events: for vLLM, start it with "
                "--kv-events-config and name the endpoint (--backend "
                "URL,kv=tcp://HOST:PORT,replay=tcp://HOST:PORT)",
            )
            self._apply(backend, verdict)
            return
        wait_s = CHECK_RETRY_S
        while True:
            try:
                verdict = await self.check.check(
                    backend.url,
                    backend.card,
                    attach=lambda watch: setattr(backend, "canary", watch),
                    catch_up=lambda: self._catch_up(backend),
                    rank=backend.dp_rank,
                )
                break
            except (aiohttp.ClientError, TimeoutError) as error:
                if not backend.healthy:  # it went away: checked again on its return
                    log.info("backend %s: check interrupted (%r)", backend.label, error)
                    return
                log.warning(
                    "backend %s: check interrupted (%r): again in %.0f s",
                    backend.label,
                    error,
                    wait_s,
                )
                await asyncio.sleep(wait_s)
                wait_s = min(2 * wait_s, CHECK_RETRY_MAX_S)
        self._apply(backend, verdict)

    def _catch_up(self, backend: Backend) -> None:
        if backend.stream is not None and self._streams is not None:
            self._streams.catch_up(backend)

    def _apply(self, backend: Backend, verdict: Verdict) -> None:
        if verdict.skipped and verdict.skipped != backend.unchecked:
            log.warning("backend %s: checks skipped: %s", backend.label, "; ".join(verdict.skipped))
        backend.unchecked = verdict.skipped
        if verdict.precise:
            backend.approximate_reason = None
            if backend.state.precise:
                backend.routing_mode = "precise"
                return
            self._remodel(backend, precise=True)  # approximate while checked: events count
            if backend.stream is None or self._streams is None:
                backend.routing_mode = "precise"
                return
            # what it published meanwhile read again: precise once that is in the index
            self._streams.relearn(backend, lambda: self._learned_again(backend))
            return
        if backend.approximate_reason != verdict.reason:
            log.warning("backend %s is routed approximately: %s", backend.label, verdict.reason)
        backend.routing_mode, backend.approximate_reason = "approximate", verdict.reason
        if backend.state.precise:
            self._remodel(backend, precise=False)

    def _learned_again(self, backend: Backend) -> None:
        if backend.routing_mode == "checking" and backend.state.precise:
            backend.routing_mode = "precise"

    def _remodel(self, backend: Backend, precise: bool) -> None:
        """Index the backend anew in its new mode (its entries start over)."""
        if backend.healthy and backend.state.replica_id in self._backends:
            self._on_removed(backend.state)
            backend.state.precise = precise
            self._on_added(backend.state)
        else:
            backend.state.precise = precise

    def _kv_streams(self) -> KVStreams:
        if self._streams is None:
            self._streams = KVStreams(asyncio.get_running_loop().call_soon_threadsafe)
        return self._streams

    async def _probe_forever(self, backend: Backend) -> None:
        """Open the backend's circuit after ``failure_threshold`` failed probes in a
        row, close it after one good probe. A backend whose stream has a heartbeat (ours)
        is alive while it beats; otherwise its ``/kv_events`` is polled every 50 ms (ours
        without a push) or its ``/health`` probed (vLLM and SGLang, whose event streams
        are quiet whenever their caches are, or a silent stream)."""
        while True:
            healthy = await self._probe(backend)
            if healthy and time.monotonic() - backend.described_at > self._describe_interval:
                await self._describe_again(backend)
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
        if backend.card is not None and backend.card.engine == "vllm":
            return await self._read_vllm_load(backend)
        try:
            async with self.client.get(
                f"{backend.url}/health", timeout=aiohttp.ClientTimeout(total=2.0)
            ) as response:
                return response.status == 200
        except (aiohttp.ClientError, TimeoutError):
            return False

    async def _read_vllm_load(self, backend: Backend) -> bool:
        """Probe a vLLM server by its ``/metrics``, whose gauges are its load
        (router/fleet/vllm_load.py): its requests running and waiting, its KV cache in
        use, its adapters; with the prompt tokens this gateway sent it that are not
        computed yet (vLLM does not say)."""
        read_at = time.time()  # the clock of dispatch times (router/path/accounting.py)
        try:
            async with self.client.get(
                f"{backend.url}/metrics", timeout=aiohttp.ClientTimeout(total=2.0)
            ) as response:
                if response.status != 200:
                    return False
                text = await response.text()
        except (aiohttp.ClientError, TimeoutError):
            return False
        state = backend.state
        prefilling = sum(
            r.predicted_uncached_tokens
            for r in state.in_flight.values()
            if r.prefilling and r.dispatched_at <= read_at
        )
        blocks = backend.card.num_blocks if backend.card is not None else None
        report = vllm_load(text, blocks, prefilling, read_at, engine=backend.dp_rank)
        if report is not None:
            self._reported(state, report)
        return True

    def _reported(self, state: ReplicaState, report: LoadReport | None) -> None:
        load.reported(state, report)
        if self._on_report is not None:
            self._on_report(state)

    async def _describe_again(self, backend: Backend) -> None:
        """Learn again what it serves (adapters are loaded and unloaded at run time)."""
        backend.described_at = time.monotonic()
        card = await describe(self.client, backend.url)
        if card is not None:
            self._learn(backend, card)

    async def _follow_events(self, backend: Backend) -> bool:
        """Hand the backend's new KV events to the policy; False if it did not answer."""
        try:
            page = await self._events_after(backend)
        except NotOfItsFleet:  # up, but not ours to read: its check says why; probe /health
            backend.events_supported = False  # (not its circuit flapping on every poll)
            return True
        except (aiohttp.ClientError, TimeoutError) as error:
            log.debug("kv events from %s: %r", backend.label, error)
            return False
        except ValueError as error:  # answered, but not a page of events
            log.debug("kv events from %s: %r", backend.label, error)
            return True
        if page is None:  # no KV events here (vLLM, SGLang): probe /health instead
            backend.events_supported = False
            return True
        events = list(page.events)
        if page.lost:  # fell behind the replica's log: start over empty
            events.insert(0, KVEvent(0, "cleared"))
        if events:
            self._events(backend, events)
        backend.last_event_seq = page.last_seq
        return True

    async def _serves_events(self, backend: Backend) -> bool:
        """Whether it answers ``/kv_events`` (ours without a push do; if it cannot be
        asked now, the canary will tell)."""
        try:
            return await self._events_after(backend) is not None
        except (aiohttp.ClientError, TimeoutError, ValueError, NotOfItsFleet):
            return True

    async def _events_after(self, backend: Backend) -> KVEventPage | None:
        """The backend's ``/kv_events`` page, or ``None`` if it has no such endpoint;
        raises ``NotOfItsFleet`` if it refuses the gateway (a fleet token it lacks)."""
        async with self.client.get(
            f"{backend.url}/kv_events",
            params={"since": backend.last_event_seq},
            timeout=aiohttp.ClientTimeout(total=5.0),
        ) as response:
            if response.status == 404:
                return None
            check_credential(response.status)
            response.raise_for_status()
            return decode_page(await response.read())


async def describe(client: aiohttp.ClientSession, url: str) -> EngineCard | None:
    """What the server at ``url`` says of itself, asked as each engine kind would be
    (``replica/api/engines.py``: ours answer ``/stats``, vLLM ``/metrics`` and
    ``/v1/models``), or ``None`` (another server, or one not up yet)."""
    timeout = aiohttp.ClientTimeout(total=5.0)
    answered: dict[str, bytes | None] = {}  # each path asked once
    try:
        for kind in ENGINES.values():
            for path in kind.card_paths:
                if path not in answered:
                    async with client.get(f"{url}{path}", timeout=timeout) as response:
                        ok = response.status == 200
                        answered[path] = await response.read() if ok else None
            answers = {p: a for p in kind.card_paths if (a := answered[p]) is not None}
            card = kind.card(url, answers)
            if card is not None:
                return card
    except (aiohttp.ClientError, TimeoutError, ValueError):
        pass
    return None


async def follow_ray_replicas(pool: BackendPool, prefix: str, interval_s: float = 1.0) -> None:
    """Keep the pool equal to the live replica actors named ``prefix*`` in this
    namespace, one round of :func:`sync_ray_replicas` every ``interval_s``."""
    while True:
        await asyncio.sleep(interval_s)
        await sync_ray_replicas(pool, prefix)


def _learned(backend: Backend) -> bool:
    """Joined, checked (its events believed or not), and its replay buffer indexed."""
    if not backend.joined or backend.routing_mode == "checking":
        return False
    endpoint = backend.kv_endpoint or (backend.card.kv_events if backend.card else None)
    return endpoint is None or (backend.stream is not None and backend.stream.learned)


async def sync_ray_replicas(pool: BackendPool, prefix: str) -> None:
    """One round: ask each actor named ``prefix*`` for its card (which starts its
    server if needed); add a new actor, re-add one that Ray restarted on another port
    (with an empty index), remove one that is gone or not answering until it answers
    again. Ray's look-ups block, so they run in a thread; actor calls are awaited."""
    import ray

    try:
        names = await asyncio.to_thread(ray.util.list_named_actors)
        wanted = sorted(name for name in names if name.startswith(prefix))
        cards = await asyncio.gather(*(_actor_card(ray, name) for name in wanted))
        live = {name: card for name, card in zip(wanted, cards, strict=True) if card}
        for backend in pool.backends:
            card = live.get(backend.server)
            if card is None or card.url != backend.url:
                await pool.remove(backend.state.replica_id)
        for name, card in live.items():
            pool.add(card.url, replica_id=name, card=card)
    except Exception as error:  # Ray busy or restarting: try again next round
        log.warning("following Ray replicas: %r", error)


async def _actor_card(ray: Any, name: str, timeout_s: float = 10.0) -> EngineCard | None:
    try:
        handle = await asyncio.to_thread(ray.get_actor, name)
        card: EngineCard = await asyncio.wait_for(handle.card.remote(), timeout=timeout_s)
        return card
    except Exception:  # dead, restarting, or removed since the listing
        return None
