"""Why SGLang's policy keeps more hits at 1x on the saturation sweep: homes for prefixes.

    python -m benchmarks.placement_homes [--loads 1] [--seeds 0,1,2]
        [--policies sglang_cache_aware,cache_aware,placed_homes,placed_homes_priced]
        [--knobs load_bound=2,recompute_weight=16] [--capacity-rps 8.25] [--routers 1]
        [--fill 0.6] [--eviction-weight 16]

An experiment, not a policy of the router: variants of ``cache_aware`` that differ only
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
- ``placed_homes_priced``: ``placed_homes`` whose copies for load pay for the hot
  prefixes they would evict where the replica's hot working set is large.

Every variant takes ``cache_aware``'s knobs (``--knobs``). In any other replay, once
registered: ``python -c "from benchmarks.placement_homes import register; register();
from prefix_router.cli import main; main()" replay --policies placed_homes ...``.
Each row is the median of the seeds, as in the sweep; the hit rates of every seed are
printed beside it. docs/results.md ("Routing at saturation") reports what it found.
"""

from __future__ import annotations

import argparse
from collections import Counter, OrderedDict
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from typing import Any

import numpy as np

from benchmarks import saturation_sweep
from benchmarks.saturation_sweep import medians, run
from router.core import Clock, ReplicaState, RoutingRequest
from router.index.prefix_index import PrefixIndex
from router.policies.cache_aware import CacheAware
from router.policies.registry import POLICIES, PolicyConfig

#: What SGLang's tree holds per worker, in tokens (router/policies/sglang.py).
TREE_TOKENS = 2**24


def snake(given: int, replicas: int) -> int:
    """The position of the ``given``-th home: 0, 1, ..., n-1, n-1, ..., 0, 0, 1, ..."""
    lap, position = divmod(given, replicas)
    return position if lap % 2 == 0 else replicas - 1 - position


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
    """``cache_aware`` with a cold prompt sent home: where a tree of the cold placements
    (SGLang's tree, fed only when a prompt is placed cold) sent 30% of it or more; a
    prompt new to it to the replica given the fewest homes, in a snake among ties.
    The group is known without the workload's help, and copies made for load leave its
    home where it was."""

    name = "placed_homes"
    threshold = 0.3  # SGLang's cache_threshold

    def __init__(self, config: PolicyConfig, clock: Clock, rng: np.random.Generator) -> None:
        super().__init__(config, clock, rng)
        index = replace(config.index, mode="approximate", ttl_s=float("inf"))
        self.placements = PrefixIndex(index, config.block_size, clock, config.model)
        self.given: Counter[str] = Counter()

    def _cold_slack(self) -> float:
        return float("inf")

    def _roomiest(self, request: RoutingRequest, near: Sequence[ReplicaState]) -> ReplicaState:
        for replica in near:
            if not self.placements.knows(replica.replica_id):
                tokens = TREE_TOKENS // self.config.block_size
                self.placements.add_replica(replica.replica_id, tokens, approximate=True)
        by_id = {r.replica_id: r for r in near}
        placed = self.placements.match(request.stride_hashes)
        homes = {r: t for r, t in placed.items() if r in by_id}
        top = max(homes.values(), default=0)
        if top and top >= self.threshold * request.num_prompt_tokens:
            chosen = min((by_id[r] for r, t in homes.items() if t == top), key=self._given)
        else:
            chosen = self._next_home(near)
            self.given[chosen.replica_id] += 1
        self.placements.record_routing(chosen.replica_id, request.stride_hashes)
        return chosen

    def _given(self, replica: ReplicaState) -> int:
        return self.given[replica.replica_id]

    def _next_home(self, near: Sequence[ReplicaState]) -> ReplicaState:
        """The replica given the fewest homes; among ties, the next in a snake over the
        replicas in rank order (the popular groups, which come first, spread)."""
        fewest = min(map(self._given, near))
        tied = sorted((r for r in near if self._given(r) == fewest), key=lambda r: r.replica_id)
        lap = sum(self.given.values()) // len(near)
        return tied[0] if lap % 2 == 0 else tied[-1]


class PlacedHomesPriced(PlacedHomes):
    """``placed_homes`` whose copies pay for the hot prefixes they evict: on a replica
    whose hot working set (the shared prefixes routed to it within the last
    ``window`` requests) and the request's uncached tokens pass ``fill`` of its KV
    cache, each token beyond it costs ``eviction_weight`` prefill tokens (a hot token
    evicted is computed again later, as a history moved is)."""

    name = "placed_homes_priced"
    prices_every_replica = True
    fill = 0.6
    eviction_weight = 16.0
    window = 1000

    def __init__(self, config: PolicyConfig, clock: Clock, rng: np.random.Generator) -> None:
        super().__init__(config, clock, rng)
        self.hot: dict[str, OrderedDict[int, tuple[int, int]]] = {}  # key -> (tokens, seq)
        self.seq = 0
        self._request: RoutingRequest | None = None

    def choose(self, request: RoutingRequest, replicas: Sequence[ReplicaState]) -> ReplicaState:
        self._request = request
        return super().choose(request, replicas)

    def on_dispatch(self, request: RoutingRequest, replica: ReplicaState) -> None:
        super().on_dispatch(request, replica)
        self.seq += 1
        if not request.stride_hashes:  # shorter than a stride: no prefix to keep hot
            return
        key, tokens = self._shared(request)
        for replica_id, held in self.hot.items():
            if replica_id != replica.replica_id:
                held.pop(key, None)  # its prefix is kept hot where it goes now
        held = self.hot.setdefault(replica.replica_id, OrderedDict())
        held.pop(key, None)
        held[key] = (tokens, self.seq)

    def _shared(self, request: RoutingRequest) -> tuple[int, int]:
        """The request's shared prefix (by two requests or more; else its whole prompt,
        maybe a new group's) as its last stride's identity and its tokens."""
        hashes = request.stride_hashes
        depth = self.popularity.depth(hashes, 2) or len(hashes)
        return hashes[depth - 1], depth * self.config.block_size * self.config.index.stride

    def working_set(self, replica_id: str, request: RoutingRequest) -> int:
        held = self.hot.get(replica_id)
        if not held:
            return 0
        while held and next(iter(held.values()))[1] < self.seq - self.window:
            held.popitem(last=False)
        own = self._shared(request)[0] if request.stride_hashes else None
        return sum(tokens for key, (tokens, _) in held.items() if key != own)

    def _unseen_by_load(self, replica: ReplicaState, uncached_tokens: int) -> float:
        request = self._request
        if uncached_tokens <= 0 or request is None or not request.stride_hashes:
            return 0.0
        room = replica.capacity_blocks * self.config.block_size * self.fill
        over = self.working_set(replica.replica_id, request) + uncached_tokens - room
        return self.eviction_weight * min(max(0.0, over), uncached_tokens)


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
    parser.add_argument("--fill", type=float, default=PlacedHomesPriced.fill)
    parser.add_argument("--eviction-weight", type=float, default=PlacedHomesPriced.eviction_weight)
    args = parser.parse_args()
    register()
    PlacedHomesPriced.fill, PlacedHomesPriced.eviction_weight = args.fill, args.eviction_weight
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
