"""Offline replay: N engines and a routing policy in virtual time.

A discrete-event simulation: a turn *arrives* (a router's policy picks a replica and
the request joins that engine's queue) and an engine step is *done* (its tokens reach
the client, finished requests release their load and schedule their session's next
turn). It drives the very ``Engine`` and ``Policy`` objects the live system uses,
never sleeps, and gives the same figures for the same seed.

A fleet may serve several models (``ReplayConfig.fleet``), each replica one, with the
LoRA adapters the workload asks for on it: every router then routes each request
among its model's replicas with that model's policy (``router/fleet/models.py``), as a
gateway does.

One module per room, each on those below it:

- ``simulation``: one run, following each request from its arrival to its end;
- ``scaling``: a fleet that grows and shrinks (the autoscaler's replicas);
- ``routers``: the routers' view of the fleet and a request's way through one
  (admission, cache budgets, the policy's choice, load at dispatch and end, the
  engines' KV events and load reports reaching them);
- ``engines``: the engines in virtual time (steps and decode bursts);
- ``metrics``: each request's record, and the shared-prefix evictions;
- ``events``: the clock and the events to come;
- ``request``, ``result``, ``config``: a request on its way, what a run gives back,
  the fleet's shape; ``bound``: the infinite-cache reference.
"""

from __future__ import annotations

from collections.abc import Callable

from loadtest.replay.bound import Bound, infinite_cache_bound
from loadtest.replay.config import ReplayConfig
from loadtest.replay.result import ReplayResult, RequestRecord
from loadtest.replay.simulation import Simulation
from loadtest.workloads import Workload

__all__ = [
    "Bound",
    "ReplayConfig",
    "ReplayResult",
    "RequestRecord",
    "Simulation",
    "infinite_cache_bound",
    "replay",
]


def replay(
    workload: Workload,
    config: ReplayConfig,
    policy: str = "round_robin",
    on_request_done: Callable[[], object] | None = None,
) -> ReplayResult:
    """``workload`` on the fleet of ``config``, routed by ``policy``; ``on_request_done``
    is called as each request ends (a progress bar's count)."""
    return Simulation(workload, config, policy, on_request_done).run()
