"""A fleet on Ray that grows and shrinks with its load, without losing a request.

One actor watches the replica actors (named ``replica-N``, as the gateways follow them)
every ``interval_s``: it adds their requests running or queued and their queued
prefill tokens, and asks ``router/fleet/autoscaler.py`` (the replayer's rule too) for the
fleet's size. To grow, it starts replica actors under the next free names; the gateways
find them within a second and route to them as soon as they serve (empty: the policy
sends them new prefixes, hot ones first where it replicates them). To shrink, it picks
the replica to stop (``scale_in``: by the cache value a gateway's index gives it, by
load, or at random), tells it to drain (its card says so: every gateway stops sending
it requests within a second), waits until it holds no request, and only then stops
it. No request is cut: the ones it held end there. A disaggregated fleet's pools
(prefill, decode: each replica's card says its role) are scaled apart, each on its own
replicas' load and signal, within the bounds, as the replayer scales them.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Sequence
from typing import Any

import httpx
import numpy as np
import ray

from deploy.engines import replica_actor
from deploy.names import REPLICA_PREFIX, SCALER_NAME
from deploy.replicas import EngineSpec, stop_replicas
from router.fleet.autoscaler import AutoscaleConfig, Autoscaler, FleetLoad, to_stop

log = logging.getLogger(__name__)

#: How long a draining replica is given to be seen draining by every gateway (they
#: follow the actors' cards every second) before its emptiness is trusted.
DRAIN_NOTICE_S = 3.0


class FleetScaler:
    """The body of the scaler actor: it watches the fleet from its construction, in the
    running event loop (Ray's, in the actor)."""

    def __init__(
        self,
        config: AutoscaleConfig,
        engines: Sequence[EngineSpec],
        host: str | None,
        gateway_url: str,
        actor_options: dict[str, Any] | None = None,
        admin_key: str | None = None,
        fleet_token: str = "",
    ) -> None:
        """``engines``: the fleet's, whose roles are its pools (a new replica of a pool
        runs its first engine); ``actor_options``: how a new replica actor is placed
        (Ray's ``options``); ``fleet_token``: what the replicas it starts ask of callers."""
        self.config, self.host, self.fleet_token = config, host, fleet_token
        self.gateway_url, self.admin_key = gateway_url, admin_key
        self.actor_options = actor_options or {"num_cpus": 0}
        self.pools: dict[str, EngineSpec] = {}
        for engine in engines:
            self.pools.setdefault(engine.role, engine)
        self.autoscalers = {role: Autoscaler(config, time.monotonic, role) for role in self.pools}
        self.rng = np.random.default_rng()
        self._draining: set[str] = set()
        self._roles: dict[str, str] = {}  # each replica's, by name, from its card
        #: The replicas it started, held: an actor lives as long as a handle to it (or
        #: for ever, detached, on a cluster).
        self._started: dict[str, Any] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        #: (time, event, replica): ``started``, ``draining``, ``stopped``, for reports.
        self.events: list[tuple[float, str, str]] = []
        # Ray runs an async actor's constructor in its event loop: the watch starts with
        # the actor (a restarted one too), not with a call its creator may not outlive.
        self._watch = asyncio.get_running_loop().create_task(self.run())

    async def run(self) -> None:
        """Watch the fleet until the actor is killed."""
        while True:
            await asyncio.sleep(self.config.interval_s)
            try:
                await self.step()
            except Exception as error:  # a replica restarting, Ray busy: next round
                log.warning("scaling the fleet: %r", error)

    async def history(self) -> list[tuple[float, str, str]]:
        return list(self.events)

    async def step(self) -> None:
        """Scale each pool once: grow it to what its autoscaler wants, or drain one."""
        serving = await self._serving()
        for role, autoscaler in self.autoscalers.items():
            pool = {name: h for name, h in serving.items() if self._roles[name] == role}
            loads = await asyncio.gather(*(h.load.remote() for h in pool.values()))
            load = FleetLoad(
                sum(x.ongoing_requests for x in loads),
                sum(x.queued_prefill_tokens for x in loads),
            )
            wanted = autoscaler.decide(len(pool), load)
            if wanted > len(pool):
                await self._grow(wanted - len(pool), role)
            elif wanted < len(pool) and len(pool) > 1:
                ongoing = {name: x.ongoing_requests for name, x in zip(pool, loads, strict=True)}
                self._drain(await self._to_stop(pool, ongoing), pool)

    async def _serving(self) -> dict[str, Any]:
        """The replica actors routed to (not draining), by name; their roles known."""
        names = await asyncio.to_thread(ray.util.list_named_actors)
        wanted = sorted(
            n for n in names if n.startswith(REPLICA_PREFIX) and n not in self._draining
        )
        handles = await asyncio.gather(*(asyncio.to_thread(ray.get_actor, n) for n in wanted))
        serving = dict(zip(wanted, handles, strict=True))
        unknown = [name for name in serving if name not in self._roles]
        cards = await asyncio.gather(*(serving[name].card.remote() for name in unknown))
        self._roles.update((name, card.role) for name, card in zip(unknown, cards, strict=True))
        return serving

    async def _grow(self, count: int, role: str) -> None:
        """Start ``count`` replicas of ``role`` under the next free names; back once
        they serve."""
        taken = set(await asyncio.to_thread(ray.util.list_named_actors))
        names = [f"{REPLICA_PREFIX}{i}" for i in range(len(taken) + count + 1)]
        fresh = [name for name in names if name not in taken][:count]
        engine = self.pools[role]
        handles = [
            replica_actor(engine)
            .options(name=name, **self.actor_options)
            .remote(engine, self.host, self.fleet_token)
            for name in fresh
        ]
        self._started.update(zip(fresh, handles, strict=True))
        self._roles.update(dict.fromkeys(fresh, role))
        await asyncio.gather(*(h.card.remote() for h in handles))
        for name in fresh:
            self.events.append((time.time(), "started", name))

    async def _to_stop(self, serving: dict[str, Any], ongoing: dict[str, int]) -> str:
        names = list(serving)
        values: dict[str, float] = {}
        if self.config.scale_in == "cache":
            values = await self._cache_values()
            if not values:  # no gateway said: the least loaded, as a load-only scaler
                return to_stop("load", names, ongoing, lambda n: 0.0, self.rng)
        return to_stop(self.config.scale_in, names, ongoing, lambda n: values.get(n, 0.0), self.rng)

    async def _cache_values(self) -> dict[str, float]:
        """What each replica's loss would cost the caches, as a gateway's index says."""
        headers = {"authorization": f"Bearer {self.admin_key}"} if self.admin_key else {}
        url = f"{self.gateway_url}/admin/cache_values"
        try:
            async with httpx.AsyncClient(timeout=10) as client:
                response = await client.get(url, headers=headers)
            response.raise_for_status()
            return {name: float(value) for name, value in response.json().items()}
        except (httpx.HTTPError, ValueError) as error:
            log.warning("no cache values from %s (%r): scaling in by load", url, error)
            return {}

    def _drain(self, name: str, serving: dict[str, Any]) -> None:
        self._draining.add(name)
        self.events.append((time.time(), "draining", name))
        task = asyncio.get_running_loop().create_task(self._retire(name, serving[name]))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _retire(self, name: str, handle: Any) -> None:
        """Drain ``name``, wait until the gateways know and it holds nothing, stop it."""
        await handle.drain.remote()
        await asyncio.sleep(DRAIN_NOTICE_S)
        while (await handle.load.remote()).ongoing_requests:
            await asyncio.sleep(self.config.interval_s)
        await asyncio.to_thread(stop_replicas, [handle])
        self._draining.discard(name)
        self._started.pop(name, None)
        self._roles.pop(name, None)
        self.events.append((time.time(), "stopped", name))


FleetScalerActor: Any = ray.remote(max_restarts=-1, max_task_retries=0)(FleetScaler)


def start_scaler(
    config: AutoscaleConfig,
    engines: Sequence[EngineSpec],
    host: str | None,
    gateway_url: str,
    replica_options: dict[str, Any] | None = None,
    detached: bool = False,
    fleet_token: str = "",
) -> Any:
    """The fleet's scaler actor, running (deploy/scaler.py), placing new replicas with
    ``replica_options`` (answering only ``fleet_token``); an admin key for the
    gateway's cache values, where keys are configured, from ``$PREFIX_ROUTER_ADMIN_KEY``."""
    lifetime = {"lifetime": "detached"} if detached else {}
    scaler = FleetScalerActor.options(name=SCALER_NAME, num_cpus=0, **lifetime).remote(
        config,
        engines,
        host,
        gateway_url,
        replica_options,
        os.environ.get("PREFIX_ROUTER_ADMIN_KEY"),
        fleet_token,
    )
    return scaler
