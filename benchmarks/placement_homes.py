"""Why SGLang's policy keeps more hits at 1x on the saturation sweep: homes for prefixes.

    python -m benchmarks.placement_homes [--loads 1] [--seeds 0,1,2]
        [--policies sglang_cache_aware,cache_aware,placed_homes,placed_homes_priced]
        [--knobs load_bound=2,recompute_weight=16] [--capacity-rps 8.25] [--routers 1]
        [--fill 0.6] [--eviction-weight 16]

An experiment: variants of ``cache_aware`` that differ only
in where a prompt cached nowhere goes, replayed on ``benchmarks/saturation_sweep.py``'s
fleet and workload (96 groups of 4,096-token prompts filling three quarters of 8
replicas' KV). ``cache_aware`` places such a prompt among the near-least-loaded replicas
by rendezvous hashing, so the groups land 8 to 16 a replica and, once evicted
everywhere, land elsewhere; SGLang's policy gives each new group the smallest tree and
sends an evicted one back to it, so its groups sit 12 a replica and never move.

- ``static_partition``: the bound: every request of a group to its home, homes given
  in turn (a snake over the replicas, so the popular groups, which come first, spread)
  and load never looked at.
- ``homes_in_turn``: ``cache_aware``, but a prompt cached nowhere goes to its group's
  home (homes as above, the group known by the prompt's first stride), whatever the
  load; a warm one is priced as ``cache_aware`` prices it.
- ``placed_homes``: the same, with homes a router can know: a tree of its cold
  placements (SGLang's tree, fed only when a prompt is placed cold) says a prompt's
  home; a prompt new to it goes to the replica given the fewest homes, in a snake.
  Since landed as a knob: ``cache_aware --homes`` (router/policies/homes.py).
- ``placed_homes_priced``: ``placed_homes`` whose copies for load pay for the hot
  prefixes they would evict where the replica's hot working set is large:
  ``cache_aware --homes --eviction-weight 16``.

Every variant takes ``cache_aware``'s knobs (``--knobs``). In any other replay, once
registered: ``python -c "from benchmarks.placement_homes import register; register();
from prefix_router.cli import main; main()" replay --policies placed_homes ...`` (or
``replay --policies cache_aware --homes``, the router's own).
Each row is the median of the seeds, as in the sweep; the hit rates of every seed are
printed beside it. docs/results.md ("Routing at saturation") reports what it found.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from typing import Any, ClassVar

import numpy as np

from benchmarks import saturation_sweep
from benchmarks.saturation_sweep import medians, run
from router.core import Clock, ReplicaState, RoutingRequest
from router.policies.cache_aware import CacheAware
from router.policies.homes import snake
from router.policies.registry import POLICIES, PolicyConfig


class HomesInTurn(CacheAware):
    """``cache_aware`` with a cold prompt sent to its group's home, given in turn."""

    name = "homes_in_turn"

    def __init__(self, config: PolicyConfig, clock: Clock, rng: np.random.Generator) -> None:
        super().__init__(config, clock, rng)
        self.homes: dict[int, int] = {}  # first stride -> position among the replicas

    def home(self, request: RoutingRequest) -> ReplicaState:
        ids = sorted(self.order.states)
        group = request.stride_hashes[0]
        if group not in self.homes:
            self.homes[group] = snake(len(self.homes), len(ids))
        return self.order.states[ids[self.homes[group]]]

    def _cold_slack(self) -> float:
        return float("inf")  # every replica is a candidate: the home decides

    def _roomiest(self, request: RoutingRequest, near: Sequence[ReplicaState]) -> ReplicaState:
        return self.home(request)


class StaticPartition(HomesInTurn):
    """Every request to its group's home: the hits of a partition that never moves."""

    name = "static_partition"

    def choose(self, request: RoutingRequest, replicas: Sequence[ReplicaState]) -> ReplicaState:
        chosen = self.home(request)
        request.predicted_cached_tokens = self._matches(request, replicas).get(chosen.replica_id, 0)
        return chosen


class PlacedHomes(CacheAware):
    """``cache_aware`` with its ``homes`` knob on (router/policies/homes.py): a prompt
    cached nowhere goes where a tree of the cold placements sent 30% of it or more; a
    prompt new to it to the replica given the fewest homes, the least loaded of those,
    in a snake among ties."""

    name = "placed_homes"
    knobs: ClassVar[dict[str, Any]] = {"homes": True, "eviction_weight": 0.0}

    def __init__(self, config: PolicyConfig, clock: Clock, rng: np.random.Generator) -> None:
        knobs = replace(config.cache_aware, **self.knobs)
        super().__init__(replace(config, cache_aware=knobs), clock, rng)


class PlacedHomesPriced(PlacedHomes):
    """``placed_homes`` whose copies pay for the hot prefixes they evict (the
    ``eviction_weight`` knob, 16 here; ``hot_fill`` 0.6), wherever shared prefixes
    crowd the caches or not (``crowded_share`` 0)."""

    name = "placed_homes_priced"
    knobs: ClassVar[dict[str, Any]] = {
        "homes": True,
        "eviction_weight": 16.0,
        "hot_fill": 0.6,
        "crowded_share": 0.0,
    }


VARIANTS = (StaticPartition, HomesInTurn, PlacedHomes, PlacedHomesPriced)


def register() -> None:
    """The variants by name, for the replayer (in this process and those it forks):
    not at import, so the router's own list of policies stays its own."""
    POLICIES.update({cls.name: cls for cls in VARIANTS})


def parse_knobs(text: str) -> dict[str, float]:
    """``load_bound=2,recompute_weight=16`` as keyword arguments of ``PolicyConfig.of``."""
    pairs = (item.split("=") for item in text.split(",") if item)
    return {name: float(value) for name, value in pairs}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--loads", default="1")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument(
        "--policies",
        default="sglang_cache_aware,cache_aware,static_partition,homes_in_turn,placed_homes,"
        "placed_homes_priced",
    )
    parser.add_argument("--knobs", default="", help="cache_aware's knobs for the variants")
    parser.add_argument("--capacity-rps", type=float, default=8.25)
    parser.add_argument("--sessions", type=int, default=3000)
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--routers", type=int, default=1, help="routers, each its own policy")
    parser.add_argument("--fill", type=float, default=PlacedHomesPriced.knobs["hot_fill"])
    parser.add_argument(
        "--eviction-weight", type=float, default=PlacedHomesPriced.knobs["eviction_weight"]
    )
    args = parser.parse_args()
    register()
    PlacedHomesPriced.knobs = {"homes": True, "eviction_weight": args.eviction_weight}
    PlacedHomesPriced.knobs["hot_fill"] = args.fill
    # the sweep's fleet with this many routers, for the workers forked below
    saturation_sweep.FLEET = replace(saturation_sweep.FLEET, routers=args.routers)
    knobs = parse_knobs(args.knobs)
    PolicyConfig.of(**knobs)  # a knob misspelt fails here, not in a worker
    seeds = [int(s) for s in args.seeds.split(",")]
    loads = [float(x) for x in args.loads.split(",")]
    policies = args.policies.split(",")
    jobs = [
        (p, f * args.capacity_rps, args.sessions, s, {} if p == "sglang_cache_aware" else knobs)
        for f in loads
        for p in policies
        for s in seeds
    ]
    with ProcessPoolExecutor(args.jobs) as pool:
        done = list(pool.map(run, jobs))
    print(
        f"knobs: {knobs or 'defaults'}; routers: {args.routers}; placed_homes_priced: "
        f"fill {args.fill:g}, eviction weight {args.eviction_weight:g}"
    )
    print("| load | policy | served req/s | hit rate (seeds) | TTFT p90 | TTFT p99 (seeds) |")
    print("|---:|---|---:|---:|---:|---:|")
    for load in loads:
        for policy in policies:
            runs = [
                d
                for d, j in zip(done, jobs, strict=True)
                if j[0] == policy and j[1] == load * args.capacity_rps
            ]
            print(row(load, policy, runs))


def row(load: float, policy: str, runs: list[dict[str, Any]]) -> str:
    m = medians(runs)
    hits = ", ".join(f"{r['token_hit_rate']:.1%}" for r in runs)
    tails = ", ".join(f"{r['ttft_p99_s']:.2f}" for r in runs)
    return (
        f"| {load:g}x | {policy} | {m['served_rps']:.2f} | {m['token_hit_rate']:.1%} ({hits}) | "
        f"{m['ttft_p90_s']:.2f} s | {m['ttft_p99_s']:.2f} s ({tails}) |"
    )


if __name__ == "__main__":
    main()
