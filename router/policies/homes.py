"""Homes for prefixes, and copies that pay for what they evict: how ``cache_aware``
keeps groups of requests still where their shared prompts crowd the fleet's caches.

Many groups of requests sharing a long prompt, filling most of the fleet's KV cache
(docs/results.md, "Routing at saturation"): there the hits come from stability. A
group that moves computes its prompt again where it lands and evicts another group
there, which moves in turn. SGLang's router keeps its groups still (its tree never
forgets, so a group evicted everywhere goes back where it was) and kept 0.8 points
more hits than ``cache_aware`` at the fleet's capacity; a partition that never moves a
group keeps as many. Two things keep ``cache_aware``'s groups still, each a knob of
:class:`~router.policies.cache_aware.CacheAwareConfig`, both on by default:

- :class:`Homes` (``homes``): a prompt cached nowhere goes home, whatever the load:
  where the router placed its prefix before, when it was cached nowhere then too (a
  tree of those placements alone, as SGLang's tree, with its size). A prefix new to
  the tree may be a group's first request, and where it lands its group will live:
  where new and shared prefixes crowd the caches, it goes to the replica given the
  fewest homes (the least loaded of those, then in a snake over the replicas: the
  popular prefixes, which come first, spread), among those whose queue is within
  ``recompute_weight`` times its prefill of the least loaded (what copying it later
  would cost), so a stream of unrelated prompts still follows the load; elsewhere (a
  chat, whose new sessions find their system prompt cached) where it evicts the
  least, as without homes.
- :class:`HotPrefixes` (``eviction_weight``): a copy made for load (a request sent
  where its prompt is not cached, while another replica holds some of it) onto a
  replica whose hot working set (the shared prefixes routed to it within the last
  ``hot_window_requests`` requests) and the copy's tokens pass ``hot_fill`` of its KV
  cache evicts hot prefixes, which will be computed again: each token beyond costs
  ``eviction_weight`` prefill tokens.

The price trades balance for stability, which pays only where shared prefixes crowd
the caches; where conversations' own histories do (a chat fleet short of KV), balance
pays (there it cost 1.3 points of hits and a fourfold TTFT p99 always on). So copies
pay only while :class:`SharedPrefixes` finds that the prefixes different requests
share (a group's prompt, an application's system prompt; not the turns of one
conversation) fill ``crowded_share`` of the fleet's KV cache or more, and while some
replica has no queue (past capacity every recompute is dear already, and a copy
drains a queue); new prefixes are placed for their groups while those and the prompts
placed cold fill it together, and before the first look (a fleet's first placements
decide where its groups live, before they are shared).

All three are the router's own: with several gateways each has its homes, hot sets
and shares (in replay, two routers keep the hits: docs/results.md).
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace

from router.core import Clock, ReplicaState, RoutingRequest
from router.index.prefix_index import IndexConfig, PrefixIndex

#: What the tree of placements holds per replica, in tokens (SGLang's tree's size).
TREE_TOKENS = 2**24
#: A prompt is at home where the tree sent this share of it or more (SGLang's
#: ``cache_threshold``).
HOME_SHARE = 0.3

#: A replica's outstanding work, in prefill tokens.
ReplicaLoad = Callable[[ReplicaState], float]


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

    def home(
        self, request: RoutingRequest, candidates: Sequence[ReplicaState], load: ReplicaLoad
    ) -> ReplicaState:
        """``request``'s home among ``candidates`` (a new prefix is given one, ``load``
        breaking ties among the fewest homes), recorded."""
        by_id = {replica.replica_id: replica for replica in candidates}
        homes = {r: t for r, t in self._homes(request, by_id).items() if r in by_id}
        if homes:
            top = max(homes.values())
            tied = (by_id[replica_id] for replica_id, t in homes.items() if t == top)
            chosen = min(tied, key=self._given)
        else:
            chosen = self._next_home(candidates, load)
            self.given[chosen.replica_id] += 1
        self.placements.record_routing(chosen.replica_id, request.stride_hashes)
        return chosen

    def placed(self, request: RoutingRequest, replica: ReplicaState) -> None:
        """``request``, new to the homes, went to ``replica`` by another rule: its home
        from now on (counted as given)."""
        self.given[replica.replica_id] += 1
        self.placements.record_routing(replica.replica_id, request.stride_hashes)

    def knows(self, request: RoutingRequest) -> bool:
        """Whether ``request``'s prefix has a home."""
        return bool(self._homes(request, ()))

    def _homes(self, request: RoutingRequest, replica_ids: Iterable[str]) -> dict[str, int]:
        """Where the tree placed ``HOME_SHARE`` of ``request``'s prompt or more before,
        and how much (the replicas of ``replica_ids`` made known to it first)."""
        for replica_id in replica_ids:
            if not self.placements.knows(replica_id):
                self.placements.add_replica(replica_id, self._tree_blocks, approximate=True)
        least = max(1.0, HOME_SHARE * request.num_prompt_tokens)
        placed = self.placements.match(request.stride_hashes)
        return {replica_id: t for replica_id, t in placed.items() if t >= least}

    def remove(self, replica_id: str) -> None:
        """A replica gone: its prefixes are new again."""
        if self.placements.knows(replica_id):
            self.placements.remove_replica(replica_id)
        self.given.pop(replica_id, None)

    def _given(self, replica: ReplicaState) -> int:
        return self.given[replica.replica_id]

    def _next_home(self, candidates: Sequence[ReplicaState], load: ReplicaLoad) -> ReplicaState:
        """The replica given the fewest homes; among ties, the least loaded (a server
        busy with other work does not take a new group for the snake's sake), then the
        next in a snake over them in the order of their identities."""
        fewest = min(map(self._given, candidates))
        tied = [r for r in candidates if self._given(r) == fewest]
        least = min(map(load, tied))
        tied = sorted((r for r in tied if load(r) == least), key=_identity)
        lap = sum(self.given[r.replica_id] for r in candidates) // len(candidates)
        return tied[0] if lap % 2 == 0 else tied[-1]


def _identity(replica: ReplicaState) -> str:
    return replica.replica_id


#: What followed a stride: nothing yet, one or two continuations (the next stride, or
#: ``ENDED`` where a request ended there), or three and more.
ENDED, BRANCHED = "ended", "branched"
Followers = tuple[int | str, ...] | str


def followed_by(followers: Followers | None, then: int | str) -> Followers:
    """``followers`` of a stride once one more request went on with ``then``.

    A conversation's next turn goes on where its last ended: that replaces the end, and
    two requests that both ended there are two (a group's prompt and two questions
    under a stride). Two turns may also part within the last turn's final stride (a
    trace's last block partly filled, a template that rewrites the tail), so requests
    that went on must go three ways before the prefix counts as shared.
    """
    if followers is None:
        return (then,)
    if followers == BRANCHED or (then in followers and then != ENDED):
        return followers
    if followers == (ENDED,):  # a next turn goes on; two requests ending alike share
        return (then,) if then != ENDED else BRANCHED
    return BRANCHED if len(followers) == 2 else (*followers, then)


class SharedPrefixes:
    """The prefixes that different requests share, and the strides of those shared within
    the last ``window`` requests, each counted once.

    A prefix is shared where two requests ended there (a group's prompt and short
    questions) or three went on differently after it (an application's system prompt
    and its sessions' questions): a conversation's history is followed by one turn
    only, the next, so it is not (:func:`followed_by`). What followed each stride is
    remembered for the last one or two windows of requests (two generations of a
    dict), so memory stays bounded.
    """

    def __init__(self, window: int, stride_tokens: int) -> None:
        self.window = window
        self.stride_tokens = stride_tokens
        self.strides = 0  # of the shared prefixes within the window, each once
        self.seen = 0  # requests recorded
        self._after: dict[int, Followers] = {}  # stride -> what followed it (this generation)
        self._before: dict[int, Followers] = {}  # the generation before
        self._recent: OrderedDict[int, tuple[int, int]] = OrderedDict()  # key -> (strides, seq)
        self._requests: OrderedDict[str, None] = OrderedDict()  # the window's, by identity
        self.cold_strides = 0  # of the prompts placed cold within the window, each once
        self._cold: OrderedDict[int, tuple[int, int]] = OrderedDict()  # key -> (strides, seq)

    def record(self, request_id: str, strides: Sequence[int]) -> None:
        """Request ``request_id`` through ``strides``: what follows each, and its deepest
        shared prefix. A request sent twice (a prefill, then its decode leg) counts once."""
        if request_id in self._requests:
            return
        self._requests[request_id] = None
        if len(self._requests) > self.window:
            self._requests.popitem(last=False)
        self.seen += 1
        if self.seen % self.window == 0:
            self._before, self._after = self._after, {}
        deepest = 0
        for position, stride in enumerate(strides):
            then = strides[position + 1] if position + 1 < len(strides) else ENDED
            before = self._after.get(stride)
            if before is None:
                before = self._before.get(stride)
            followers = self._after[stride] = followed_by(before, then)
            if followers == BRANCHED:
                deepest = position + 1
        if deepest:
            self.strides += _note(self._recent, strides[deepest - 1], deepest, self.seen)
        self.strides -= _expire(self._recent, self.seen - self.window)
        self.cold_strides -= _expire(self._cold, self.seen - self.window)

    def placed_cold(self, strides: Sequence[int]) -> None:
        """A prompt cached nowhere was placed: it needs its tokens of KV (maybe a new
        group's prompt, that requests will share)."""
        self.cold_strides += _note(self._cold, strides[-1], len(strides), self.seen)

    def needs(self, fleet_tokens: int) -> tuple[float, float]:
        """The shares of ``fleet_tokens`` that the shared prefixes need, and that they
        and the prompts placed cold need together."""
        shared = self.strides * self.stride_tokens / fleet_tokens
        return shared, shared + self.cold_strides * self.stride_tokens / fleet_tokens


def _note(window: OrderedDict[int, tuple[int, int]], key: int, strides: int, seq: int) -> int:
    """``key``, ``strides`` long, seen at ``seq``: the strides it adds to ``window``."""
    before = window.pop(key)[0] if key in window else 0
    window[key] = (strides, seq)
    return strides - before


def _expire(window: OrderedDict[int, tuple[int, int]], oldest: int) -> int:
    """Drop the keys of ``window`` seen at ``oldest`` or before: the strides dropped."""
    dropped = 0
    while window and next(iter(window.values()))[1] <= oldest:
        dropped += window.popitem(last=False)[1][0]
    return dropped


class HotPrefixes:
    """Each replica's hot working set: the shared prefixes routed to it within the last
    ``window`` requests, each where it went last, in tokens."""

    def __init__(self, window: int) -> None:
        self.window = window
        self.seq = 0
        self._held: dict[str, OrderedDict[int, tuple[int, int]]] = {}  # key -> (tokens, seq)
        self._where: dict[int, str] = {}  # key -> the replica it went to last
        self._tokens: Counter[str] = Counter()

    def routed(self, replica_id: str, key: int | None, tokens: int) -> None:
        """A request through the shared prefix ``key`` (of ``tokens``; ``None``: a
        prompt shorter than a stride, counted in the window only) went to
        ``replica_id``: hot there, and no longer where it went before."""
        self.seq += 1
        if key is None:
            return
        before = self._where.get(key)
        if before is not None and key in self._held.get(before, {}):
            self._tokens[before] -= self._held[before].pop(key)[0]
        self._where[key] = replica_id
        held = self._held.setdefault(replica_id, OrderedDict())
        held[key] = (tokens, self.seq)
        self._tokens[replica_id] += tokens
        self._expire(replica_id, held)

    def tokens(self, replica_id: str, but: int | None = None) -> int:
        """The hot tokens on ``replica_id``, but those of the prefix ``but``."""
        held = self._held.get(replica_id)
        if not held:
            return 0
        self._expire(replica_id, held)
        own = held[but][0] if but is not None and but in held else 0
        return self._tokens[replica_id] - own

    def _expire(self, replica_id: str, held: OrderedDict[int, tuple[int, int]]) -> None:
        """Those routed to ``replica_id`` before the window are no longer hot."""
        while held and next(iter(held.values()))[1] < self.seq - self.window:
            key, (tokens, _) = held.popitem(last=False)
            self._tokens[replica_id] -= tokens
            if self._where.get(key) == replica_id:
                del self._where[key]

    def remove(self, replica_id: str) -> None:
        for key in self._held.pop(replica_id, {}):
            if self._where.get(key) == replica_id:
                del self._where[key]
        self._tokens.pop(replica_id, None)
