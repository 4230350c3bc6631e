"""Homes for prefixes, and copies that pay for what they evict: ``cache_aware``'s two
knobs for a fleet whose caches are short of its shared prefixes.

Many groups of requests sharing a long prompt, filling most of the fleet's KV cache
(docs/results.md, "Routing at saturation"): there the hits come from stability. A
group that moves computes its prompt again where it lands and evicts another group
there, which moves in turn. SGLang's router keeps its groups still (its tree never
forgets, so a group evicted everywhere goes back where it was) and keeps 0.8 points
more hits than ``cache_aware`` at the fleet's capacity; a partition that never moves a
group keeps as many. Two things keep ``cache_aware``'s groups still, each a knob of
:class:`~router.policies.cache_aware.CacheAwareConfig`:

- :class:`Homes` (``homes``): a prompt cached nowhere goes home, whatever the load:
  where the router placed its prefix before, when it was cached nowhere then too (a
  tree of those placements alone, as SGLang's tree, with its size); a prefix new to the
  tree goes to the replica given the fewest homes, in a snake over the replicas (the
  popular prefixes, which come first, spread).
- :class:`HotPrefixes` (``eviction_weight``): a copy made for load (a request sent
  where its prompt is not cached, while another replica holds some of it) onto a
  replica whose hot working set (the shared prefixes routed to it within the last
  ``hot_window_requests`` requests) and the copy's tokens pass ``hot_fill`` of its KV
  cache evicts hot prefixes, which will be computed again: each token beyond costs
  ``eviction_weight`` prefill tokens.

Both are the router's own: with several gateways each has its homes and hot sets
(in replay, two routers keep the hits: docs/results.md).
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Sequence
from dataclasses import replace

from router.core import Clock, ReplicaState, RoutingRequest
from router.index.prefix_index import IndexConfig, PrefixIndex

#: What the tree of placements holds per replica, in tokens (SGLang's tree's size).
TREE_TOKENS = 2**24
#: A prompt is at home where the tree sent this share of it or more (SGLang's
#: ``cache_threshold``).
HOME_SHARE = 0.3


def snake(given: int, replicas: int) -> int:
    """The position of the ``given``-th home: 0, 1, ..., n-1, n-1, ..., 0, 0, 1, ..."""
    lap, position = divmod(given, replicas)
    return position if lap % 2 == 0 else replicas - 1 - position


class Homes:
    """Where each prefix placed while cached nowhere lives."""

    def __init__(self, index: IndexConfig, block_size: int, clock: Clock, model: str) -> None:
        never_forgets = replace(index, mode="approximate", ttl_s=float("inf"))
        self.placements = PrefixIndex(never_forgets, block_size, clock, model)
        self.given: Counter[str] = Counter()
        self._tree_blocks = TREE_TOKENS // block_size

    def home(self, request: RoutingRequest, candidates: Sequence[ReplicaState]) -> ReplicaState:
        """``request``'s home among ``candidates`` (a new prefix is given one), recorded."""
        by_id = {replica.replica_id: replica for replica in candidates}
        for replica_id in by_id:
            if not self.placements.knows(replica_id):
                self.placements.add_replica(replica_id, self._tree_blocks, approximate=True)
        placed = self.placements.match(request.stride_hashes)
        homes = {replica_id: t for replica_id, t in placed.items() if replica_id in by_id}
        top = max(homes.values(), default=0)
        if top and top >= HOME_SHARE * request.num_prompt_tokens:
            tied = (by_id[replica_id] for replica_id, t in homes.items() if t == top)
            chosen = min(tied, key=self._given)
        else:
            chosen = self._next_home(candidates)
            self.given[chosen.replica_id] += 1
        self.placements.record_routing(chosen.replica_id, request.stride_hashes)
        return chosen

    def remove(self, replica_id: str) -> None:
        """A replica gone: its prefixes are new again."""
        if self.placements.knows(replica_id):
            self.placements.remove_replica(replica_id)
        self.given.pop(replica_id, None)

    def _given(self, replica: ReplicaState) -> int:
        return self.given[replica.replica_id]

    def _next_home(self, candidates: Sequence[ReplicaState]) -> ReplicaState:
        """The replica given the fewest homes; among ties, the next in a snake over
        them in the order of their identities."""
        fewest = min(map(self._given, candidates))
        tied = sorted((r for r in candidates if self._given(r) == fewest), key=_identity)
        lap = sum(self.given[r.replica_id] for r in candidates) // len(candidates)
        return tied[0] if lap % 2 == 0 else tied[-1]


def _identity(replica: ReplicaState) -> str:
    return replica.replica_id


class HotPrefixes:
    """Each replica's hot working set: the shared prefixes routed to it within the last
    ``window`` requests, each where it went last, in tokens."""

    def __init__(self, window: int) -> None:
        self.window = window
        self.seq = 0
        self._held: dict[str, OrderedDict[int, tuple[int, int]]] = {}  # key -> (tokens, seq)
        self._tokens: Counter[str] = Counter()

    def routed(self, replica_id: str, key: int | None, tokens: int) -> None:
        """A request through the shared prefix ``key`` (of ``tokens``; ``None``: a
        prompt shorter than a stride, counted in the window only) went to
        ``replica_id``: hot there, and no longer where it went before."""
        self.seq += 1
        if key is None:
            return
        for other, held in self._held.items():
            if other != replica_id and key in held:
                self._tokens[other] -= held.pop(key)[0]
        held = self._held.setdefault(replica_id, OrderedDict())
        if key in held:
            self._tokens[replica_id] -= held.pop(key)[0]
        held[key] = (tokens, self.seq)
        self._tokens[replica_id] += tokens

    def tokens(self, replica_id: str, but: int | None = None) -> int:
        """The hot tokens on ``replica_id``, but those of the prefix ``but``."""
        held = self._held.get(replica_id)
        if not held:
            return 0
        while held and next(iter(held.values()))[1] < self.seq - self.window:
            self._tokens[replica_id] -= held.popitem(last=False)[1][0]
        own = held[but][0] if but is not None and but in held else 0
        return self._tokens[replica_id] - own

    def remove(self, replica_id: str) -> None:
        self._held.pop(replica_id, None)
        self._tokens.pop(replica_id, None)
