"""Which replica holds which prefix: block identity -> replicas, for the router.

For a prompt, :meth:`PrefixIndex.match` answers how many leading tokens each replica
holds, in one pass over the prompt's keys, stopping as soon as no replica matches.
Keys are the router's own (``replica.api.identity.prefix_keys``): a chained hash
over every ``stride``-th block boundary, so matches are counted in steps of
``stride`` blocks; the replicas' events are turned into the same keys from the
tokens they carry (``router/index/event_keys.py``).

Two sources of knowledge, each a :class:`ReplicaSets`:

- *approximate*: the index learns from its own routing decisions: a prompt sent to
  a replica is assumed cached there. Each replica's entries form an LRU sized to the
  replica's capacity, and entries older than a TTL are forgotten.
- *precise*: the replicas' KV events (stored, removed, cleared) say what they hold.
  Routing decisions of the last few seconds count as well, to cover events that
  have not arrived yet; a removal, newer than those decisions, drops them too, and so
  does an answer whose engine reported fewer cached tokens than predicted
  (:meth:`PrefixIndex.correct`). An answer with fewer than the events themselves said,
  where they told of no eviction since the dispatch, means the index and the engine
  disagree (blocks let go without an event): what they said of that prompt beyond the
  cached tokens is dropped (:meth:`PrefixIndex.disagree`) and the replica's stream is
  applied again from the dispatch on. A prompt of a request in flight on a replica stays
  held there whatever its events say (:class:`InFlight`): the replica holds it, or will
  once it runs the request. Events from a replica's host tier (``medium`` CPU) go
  to a set of their own: :meth:`PrefixIndex.match_host` says how much further than its
  GPU a replica holds a prompt in host memory.

A precise index may hold some replicas approximately: those whose events cannot be
trusted (another block size, another tokenizer: see ``router/fleet/backend_check.py``).
Their events are ignored and their decisions kept as in approximate mode, so they are
routed on what the router sent them rather than blind.

Memory is bounded by the replicas' total capacity (and the requests in flight) whatever
the traffic, and removing a replica removes all its entries.
"""

from __future__ import annotations

import logging
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Literal

from replica.api.identity import DEFAULT_MODEL
from replica.api.kv_events import KVEvent
from router.index.event_keys import EventKeys
from router.index.lean_index import KeySets

log = logging.getLogger(__name__)

IndexMode = Literal["approximate", "precise"]
_NOBODY: dict[int, int] = {}
#: match() first probes COARSE depths ahead, then twice as far, and so on.
COARSE = 8


@dataclass(frozen=True)
class IndexConfig:
    #: Set by the policy (``cache_aware`` or ``cache_aware_approx``), so it takes no flag.
    mode: IndexMode = field(default="precise", metadata={"flag": False})
    #: The router hashes every ``stride``-th block boundary (4 x 16 = 64 tokens).
    stride: int = 4
    #: Approximate mode forgets a prefix not routed for this long.
    ttl_s: float = 600.0
    #: Precise mode trusts its own routing decisions for this long before events agree.
    recent_s: float = 5.0

    def __post_init__(self) -> None:
        if self.mode not in ("approximate", "precise"):
            raise ValueError(f"index mode must be approximate or precise, got {self.mode!r}")
        if self.stride < 1 or self.ttl_s <= 0 or self.recent_s < 0:
            raise ValueError("stride and ttl_s must be positive, recent_s not negative")


class ReplicaSets:
    """identity -> bitmask of replicas, with one bounded LRU of identities per replica.

    Each replica's ``capacity`` bounds its entries (``None``: bounded by its source, such
    as a replica's own events); its ``ttl_s`` expires entries not touched for that long.
    """

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self.holders: dict[int, int] = {}
        self._next_expiry = float("-inf")
        self._entries: dict[int, OrderedDict[int, float]] = {}  # bit -> identity -> last touch
        self._capacity: dict[int, int | None] = {}
        self._ttl: dict[int, float | None] = {}

    def add_replica(self, bit: int, capacity: int | None, ttl_s: float | None = None) -> None:
        self._entries[bit] = OrderedDict()
        self._capacity[bit] = capacity
        self._ttl[bit] = ttl_s

    def remove_replica(self, bit: int) -> None:
        self.clear(bit)
        del self._entries[bit], self._capacity[bit], self._ttl[bit]

    def __len__(self) -> int:
        return len(self.holders)

    def size(self, bit: int) -> int:
        return len(self._entries[bit])

    def keys(self, bit: int) -> Iterable[int]:
        return self._entries[bit].keys()

    def add(self, bit: int, hashes: Sequence[int]) -> None:
        entries, mask, now = self._entries[bit], 1 << bit, self.clock()
        holders, capacity = self.holders, self._capacity[bit]
        ordered = capacity is not None or self._ttl[bit] is not None
        # Deepest first, so a prefix's first blocks are the freshest and the LRU (and
        # the TTL) drop a prefix from its end, as leaf-only eviction does.
        for block_hash in reversed(hashes):
            entries[block_hash] = now
            if ordered:
                entries.move_to_end(block_hash)
            holders[block_hash] = holders.get(block_hash, 0) | mask
        while capacity is not None and len(entries) > capacity:
            self._drop(bit, entries.popitem(last=False)[0])

    def discard(self, bit: int, hashes: Iterable[int]) -> None:
        entries = self._entries[bit]
        for block_hash in hashes:
            if entries.pop(block_hash, None) is not None:
                self._drop(bit, block_hash)

    def clear(self, bit: int) -> None:
        entries = self._entries[bit]
        for block_hash in entries:
            self._drop(bit, block_hash)
        entries.clear()

    def expire(self) -> None:
        """Forget entries older than their replica's TTL: the oldest sit at the front of
        each LRU.

        Runs at most every eighth of the shortest TTL, so an entry lives up to 1.125 TTLs.
        """
        ttls = [ttl for ttl in self._ttl.values() if ttl is not None]
        if not ttls:
            return
        now = self.clock()
        if now < self._next_expiry:
            return
        self._next_expiry = now + min(ttls) / 8
        for bit, entries in self._entries.items():
            ttl = self._ttl[bit]
            if ttl is None:
                continue
            horizon = now - ttl
            while entries and next(iter(entries.values())) < horizon:
                self._drop(bit, entries.popitem(last=False)[0])

    def _drop(self, bit: int, block_hash: int) -> None:
        _drop_holder(self.holders, bit, block_hash)


class InFlight:
    """identity -> bitmask of the replicas running or queueing a request through it.

    Such a replica holds the prefix, or will once it runs the request: an eviction
    while the request waits in its queue only means the engine computes the prefix
    again there. Past a fleet's capacity, where requests wait for tens of seconds and
    engines short of KV evict the cached prompts of requests still queued, the index
    would otherwise forget where a group's requests are going and send its next
    request to a second replica, to compute the prompt twice and evict more.

    Such evictions are remembered while a request through them is in flight
    (:meth:`evicted`): an answer that then finds less cached than the events said at its
    dispatch was told so, and is no sign that the events and the engine disagree.
    """

    def __init__(self) -> None:
        self.holders: dict[int, int] = {}
        self._requests: dict[int, dict[int, int]] = {}  # bit -> identity -> requests
        self._evicted: dict[int, set[int]] = {}  # bit -> identities removed while in flight

    def __len__(self) -> int:
        return len(self.holders)

    def size(self, bit: int) -> int:
        return len(self._requests.get(bit, ()))

    def add(self, bit: int, hashes: Sequence[int]) -> None:
        requests, mask, holders = self._requests.setdefault(bit, {}), 1 << bit, self.holders
        for block_hash in hashes:
            count = requests.get(block_hash, 0)
            if not count:
                holders[block_hash] = holders.get(block_hash, 0) | mask
            requests[block_hash] = count + 1

    def remove(self, bit: int, hashes: Sequence[int]) -> None:
        requests = self._requests.get(bit)
        if requests is None:
            return
        evicted = self._evicted.get(bit)
        for block_hash in hashes:
            count = requests.pop(block_hash, 0) - 1
            if count > 0:
                requests[block_hash] = count
            elif count == 0:
                self._drop(bit, block_hash)
                if evicted:
                    evicted.discard(block_hash)

    def clear(self, bit: int) -> None:
        for block_hash in self._requests.pop(bit, {}):
            self._drop(bit, block_hash)
        self._evicted.pop(bit, None)

    def evicted(self, bit: int, hashes: Iterable[int] | None) -> None:
        """The replica's events removed ``hashes`` (``None``: everything): remember those
        that a request in flight there runs through, until no such request is left."""
        requests = self._requests.get(bit)
        if not requests:
            return
        gone = requests.keys() if hashes is None else [h for h in hashes if h in requests]
        if gone:
            self._evicted.setdefault(bit, set()).update(gone)

    def was_evicted(self, bit: int, hashes: Iterable[int]) -> bool:
        """Whether the replica's events removed any of ``hashes`` while in flight there."""
        evicted = self._evicted.get(bit)
        return evicted is not None and any(block_hash in evicted for block_hash in hashes)

    def _drop(self, bit: int, block_hash: int) -> None:
        _drop_holder(self.holders, bit, block_hash)


class PrefixIndex:
    """The router's view of every replica's prefix cache (see the module docstring)."""

    def __init__(
        self,
        config: IndexConfig,
        block_size: int,
        clock: Callable[[], float],
        model: str = DEFAULT_MODEL,
    ) -> None:
        self.config = config
        self.block_size = block_size
        self.model = model
        self.stride_tokens = block_size * config.stride
        self.clock = clock
        self._keys: dict[int, EventKeys] = {}  # by replica bit: its blocks from its events
        self._bits: dict[str, int] = {}
        self._ids: dict[int, str] = {}  # the other way round
        self._all_bits = 0
        self._approximate_bits = 0  # replicas routed on decisions alone, events ignored
        precise = config.mode == "precise"
        self._routed_ttl_s = config.recent_s if precise else config.ttl_s
        self.routed = ReplicaSets(clock)
        self.in_flight = InFlight()  # precise mode's: its decisions expire, requests wait
        #: Times a replica's events were forgotten for saying it held more than it can.
        self.overfull_resets: Counter[str] = Counter()
        # What the events say, packed (router/index/lean_index.py): a key per stride block of
        # every replica's cache, a thousand replicas' worth.
        self.stored = KeySets() if precise else None
        self.host = KeySets() if precise else None

    # ------------------------------------------------------------- replicas

    def add_replica(self, replica_id: str, capacity_blocks: int, approximate: bool = False) -> None:
        """Index a replica; ``approximate``: its events are not to be trusted, so it is
        known from decisions alone, kept as long as approximate mode keeps them."""
        if replica_id in self._bits:
            return
        bit = min(set(range(len(self._bits) + 1)) - set(self._bits.values()))
        self._bits[replica_id], self._ids[bit] = bit, replica_id
        self._all_bits |= 1 << bit
        capacity, ttl_s = max(1, capacity_blocks // self.config.stride), self._routed_ttl_s
        if approximate and self.stored is not None:
            self._approximate_bits |= 1 << bit
            ttl_s = self.config.ttl_s
        self.routed.add_replica(bit, capacity, ttl_s)
        precise = self.stored is not None and not approximate  # its table is sized to its cache
        self._keys[bit] = EventKeys(
            self.model, self.block_size, self.config.stride, capacity_blocks if precise else 0
        )

    def remove_replica(self, replica_id: str) -> None:
        bit = self._bits.pop(replica_id, None)
        if bit is None:
            return
        del self._ids[bit]
        self._all_bits &= ~(1 << bit)
        self._approximate_bits &= ~(1 << bit)
        self.routed.remove_replica(bit)
        self.in_flight.clear(bit)
        for sets in self._event_sets:
            sets.clear(bit)
        del self._keys[bit]

    @property
    def _event_sets(self) -> list[KeySets]:
        return [s for s in (self.stored, self.host) if s is not None]

    @property
    def replicas(self) -> list[str]:
        return list(self._bits)

    def knows(self, replica_id: str) -> bool:
        return replica_id in self._bits

    def is_precise(self, replica_id: str) -> bool:
        """Whether what ``replica_id`` holds is known from its events (not from the
        router's decisions alone)."""
        bit = self._bits.get(replica_id)
        return self.stored is not None and bit is not None and not self._approximate_bits >> bit & 1

    def num_entries(self, replica_id: str | None = None) -> int:
        """Identities known (for one replica, or in all), for the memory bound."""
        sets: list[ReplicaSets | KeySets | InFlight] = [
            self.routed,
            self.in_flight,
            *self._event_sets,
        ]
        if replica_id is None:
            return sum(len(s) for s in sets)
        bit = self._bits.get(replica_id)
        return 0 if bit is None else sum(s.size(bit) for s in sets)

    def gpu_keys(self, replica_id: str) -> int:
        """Stride keys the replica's GPU holds: as its events say (the same for every
        router that reads them), else as the router's decisions say."""
        bit = self._bits.get(replica_id)
        if bit is None:
            return 0
        if self.stored is not None and self.is_precise(replica_id):
            return self.stored.size(bit)
        return self.routed.size(bit)

    def gpu_blocks_by_salt(self, replica_id: str) -> dict[str | None, int]:
        """Precise mode: the blocks a replica's GPU holds, by the cache salt of their
        prompt (a tenant's footprint, where the gateway salts by tenant)."""
        keys = self._precise_keys(replica_id)
        return dict(keys.gpu_blocks_by_salt) if keys else {}

    def gpu_blocks_of(self, replica_id: str, salts: Iterable[str | None]) -> int:
        """Precise mode: the blocks a replica's GPU holds under any of ``salts`` (a
        tenant's, for its cache budget: router/fair/cache_budget.py)."""
        keys = self._precise_keys(replica_id)
        counts = keys.gpu_blocks_by_salt if keys else {}
        return sum(counts.get(salt, 0) for salt in salts)

    def exclusive_keys(self, replica_id: str) -> list[int]:
        """The stride keys that this replica alone holds on its GPU, as far as the
        index knows (its events, or the router's recent decisions): what the fleet's
        caches lose when it stops (router/fleet/autoscaler.py). A pass over its keys."""
        bit = self._bits.get(replica_id)
        if bit is None:
            return []
        stored, routed = self.stored, self.routed.holders
        keys = set(self.routed.keys(bit))
        if stored is not None and self.is_precise(replica_id):
            keys.update(stored.held(bit))
        alone, everyone = 1 << bit, self._all_bits
        held = (lambda key: stored.get(key, 0)) if stored is not None else (lambda key: 0)
        return [key for key in keys if (routed.get(key, 0) | held(key)) & everyone == alone]

    def _precise_keys(self, replica_id: str) -> EventKeys | None:
        """The keys of a replica known from its events (``None``: not such a one)."""
        return self._keys.get(self._bits[replica_id]) if self.is_precise(replica_id) else None

    # --------------------------------------------------------------- queries

    def match(self, stride_hashes: Sequence[int]) -> dict[str, int]:
        """Leading tokens held, by replica, for identities at every stride boundary;
        replicas that hold none are left out.

        Each replica's entries are prefix-closed (a prefix is dropped from its end
        first, as leaf-only eviction does), so who holds depth d can only shrink as d
        grows. So the scan gallops: it probes ``COARSE`` depths ahead, then twice as far,
        and so on while nobody drops out, and finds where someone does by bisection.
        A drop costs a few look-ups, whatever the prompt's length: an 8k-token prompt held
        whole costs 6 (16 probing every 8th depth, 125 one by one), a 240k-token one 10
        (470 probing every 8th). Only the
        replicas holding the first identity are followed, so the cost grows with them,
        not with the fleet.
        """
        self.routed.expire()
        routed = self.routed.holders.get
        stored = self.stored.get if self.stored is not None else _NOBODY.get
        in_flight = self.in_flight.holders.get

        def holders(depth: int) -> int:
            block_hash = stride_hashes[depth]
            return routed(block_hash, 0) | stored(block_hash, 0) | in_flight(block_hash, 0)

        depth_of_bit: dict[int, int] = {}
        length = len(stride_hashes)
        alive = holders(0) & self._all_bits if length else 0
        done = 1  # every replica in ``alive`` holds the depths below it
        while alive and done < length:
            drop = self._first_drop(holders, alive, done, length)
            if drop == length:
                break
            mask = holders(drop) & alive
            for bit in _bits_of(alive & ~mask):
                depth_of_bit[bit] = drop
            alive, done = mask, drop + 1
        for bit in _bits_of(alive):  # held the whole prompt
            depth_of_bit[bit] = length
        tokens = self.stride_tokens
        return {self._ids[bit]: depth * tokens for bit, depth in depth_of_bit.items() if depth}

    @staticmethod
    def _first_drop(holders: Callable[[int], int], alive: int, done: int, length: int) -> int:
        """The first depth from ``done`` at which a replica of ``alive`` holds nothing
        (``length``: none drops out), galloping then bisecting."""
        low, reach = done, COARSE
        while True:  # invariant: all of ``alive`` hold every depth below ``low``
            probe = min(low + reach, length) - 1
            if holders(probe) & alive != alive:
                break
            if probe == length - 1:
                return length
            low, reach = probe + 1, reach * 2
        high = probe  # someone drops out at a depth in [low, high]
        while low < high:
            middle = (low + high) // 2
            if holders(middle) & alive == alive:
                low = middle + 1
            else:
                high = middle
        return low

    def match_host(self, stride_hashes: Sequence[int], gpu: dict[str, int]) -> dict[str, int]:
        """Tokens each replica holds in host memory beyond the ``gpu`` tokens it holds on
        the GPU (as :meth:`match` answered), in a row; replicas with none left out."""
        host = self.host
        if host is None or not len(host):
            return {}
        holders, stride_tokens, extra = host, self.stride_tokens, {}
        # Those with GPU tokens, and those whose host tier holds the first identity.
        first = holders.get(stride_hashes[0], 0) & self._all_bits if stride_hashes else 0
        candidates = {*gpu, *(self._ids[bit] for bit in _bits_of(first))}
        for replica in candidates:
            bit = self._bits[replica]
            start = depth = gpu.get(replica, 0) // stride_tokens
            mask = 1 << bit
            while depth < len(stride_hashes) and holders.get(stride_hashes[depth], 0) & mask:
                depth += 1
            if depth > start:
                extra[replica] = (depth - start) * stride_tokens
        return extra

    # --------------------------------------------------------------- updates

    def record_routing(self, replica_id: str, stride_hashes: Sequence[int]) -> None:
        """The request went to ``replica_id``: assume its prompt is cached there now.

        Of a replica known from its events, only the part its events do not show yet is
        recorded (a decision stands in for events until they arrive): a conversation's
        next turn costs its new strides, not its whole history again.
        """
        bit = self._bits.get(replica_id)
        if bit is None:
            return
        if self.is_precise(replica_id):
            stride_hashes = stride_hashes[self._shown(bit, stride_hashes) :]
        self.routed.add(bit, stride_hashes)

    def events_held(self, replica_id: str, stride_hashes: Sequence[int]) -> int | None:
        """Leading tokens of the prompt that the replica's events alone say its GPU holds
        (not its decisions nor its requests in flight); ``None``: it is not known from its
        events. A gallop, as :meth:`match`'s."""
        if not self.is_precise(replica_id):
            return None
        return self._shown(self._bits[replica_id], stride_hashes) * self.stride_tokens

    def _shown(self, bit: int, stride_hashes: Sequence[int]) -> int:
        """Leading strides of the prompt that replica ``bit``'s events show on its GPU."""
        if self.stored is None or not stride_hashes:
            return 0
        held = self.stored.get
        return self._first_drop(
            lambda depth: held(stride_hashes[depth], 0), 1 << bit, 0, len(stride_hashes)
        )

    def request_started(self, replica_id: str, stride_hashes: Sequence[int]) -> None:
        """A request through this prompt was sent to ``replica_id``: until it ends, the
        replica holds the prompt whatever its events say (see :class:`InFlight`). Of
        replicas known from their events only: decisions stand for the others."""
        if self.is_precise(replica_id):
            self.in_flight.add(self._bits[replica_id], stride_hashes)

    def request_ended(self, replica_id: str, stride_hashes: Sequence[int]) -> None:
        """The request of :meth:`request_started` ended: its prompt is held there as
        far as the replica's events say."""
        bit = self._bits.get(replica_id)
        if bit is not None:
            self.in_flight.remove(bit, stride_hashes)

    def apply_events(self, replica_id: str, events: Iterable[KVEvent]) -> int:
        """Precise mode: mirror a replica's stored / removed / cleared blocks. A block
        removed from the GPU is no longer assumed there from a recent decision either:
        the removal is the newer news. Returns how many stored blocks could not be
        keyed (see ``router/index/event_keys.py``)."""
        bit = self._bits.get(replica_id)
        if bit is None or self.stored is None or self.host is None:
            return 0
        if self._approximate_bits >> bit & 1:
            return 0
        keys = self._keys[bit]
        unkeyed = keys.unkeyed
        for event in events:
            sets = self.host if event.medium == "CPU" else self.stored
            if event.kind == "stored":
                sets.add(bit, keys.stored(event))
            elif event.kind == "removed":
                gone = keys.removed(event)
                sets.discard(bit, gone)
                if event.medium == "GPU":
                    self.routed.discard(bit, gone)
                    self.in_flight.evicted(bit, gone)
            else:  # both tiers emptied
                self._forget_events(bit)
                self.routed.clear(bit)
        if keys.overfull:
            self._forget_events(bit)
            self.overfull_resets[replica_id] += 1
            if self.overfull_resets[replica_id] == 1:  # counted after: not a line each time
                log.warning(
                    "replica %s: its KV events say it holds more than twice the %d blocks "
                    "it has (removals lost or never sent, or a cache larger than the "
                    "router was told: --capacity-blocks): what they said is forgotten "
                    "and learned again from its next events",
                    replica_id,
                    keys.capacity,
                )
        return keys.unkeyed - unkeyed

    def _forget_events(self, bit: int) -> None:
        """Forget what a replica's events said, in both tiers (for the requests in flight
        there, as if every block of theirs had been removed)."""
        assert self.stored is not None and self.host is not None
        self.stored.clear(bit)
        self.host.clear(bit)
        self._keys[bit].clear()
        self.in_flight.evicted(bit, None)

    def correct(self, replica_id: str, stride_hashes: Sequence[int], cached_tokens: int) -> None:
        """The engine found only ``cached_tokens`` of this prompt cached, no fewer than its
        events said at the dispatch: forget the decisions that said it held more. Precise
        mode only: there the events, not the decisions, say what the request left cached;
        in approximate mode the decision just made is right again, since the engine has
        now computed the prompt. (Fewer than the events said: :meth:`disagree`.)"""
        bit = self._bits.get(replica_id)
        if bit is None or self.stored is None or self._approximate_bits >> bit & 1:
            return
        self.routed.discard(bit, stride_hashes[cached_tokens // self.stride_tokens :])

    def evicted_in_flight(self, replica_id: str, stride_hashes: Sequence[int]) -> bool:
        """Whether the replica's events removed any of these keys (or forgot all it held)
        while a request through them was in flight there: told, not withheld."""
        bit = self._bits.get(replica_id)
        return bit is not None and self.in_flight.was_evicted(bit, stride_hashes)

    def disagree(self, replica_id: str, stride_hashes: Sequence[int], cached_tokens: int) -> None:
        """The engine found only ``cached_tokens`` of this prompt cached where the replica's
        events had said more, and told of no eviction since: forget what the events and
        the decisions said of the prompt beyond ``cached_tokens``. The caller has the
        replica's stream applied again from the request's dispatch on (its
        :class:`~router.core.KVStream`), which brings back what the engine stored since,
        the request's own blocks among them, but not what it let go without telling."""
        bit = self._bits.get(replica_id)
        if bit is None or self.stored is None or not self.is_precise(replica_id):
            return
        beyond = stride_hashes[cached_tokens // self.stride_tokens :]
        self.stored.discard(bit, beyond)
        self.routed.discard(bit, beyond)


class PrefixPopularity:
    """How many recent requests passed through each prefix, by stride identity.

    Every request passing a stride passed all the strides before it, so counts never
    grow along a prompt: the popular part of a prompt is found by binary search, in
    a handful of look-ups on the routing path. Counting happens at dispatch. Every
    count halves each ``half_life_requests`` requests, so counts measure recent
    traffic and memory stays bounded (a count that reaches zero is dropped).
    """

    def __init__(self, half_life_requests: int = 4096) -> None:
        self._counts: dict[int, int] = {}
        self._half_life = half_life_requests
        self._seen = 0

    def record(self, stride_hashes: Sequence[int]) -> None:
        """Count one request through each of its prefixes."""
        self._seen += 1
        if self._seen % self._half_life == 0:
            self._counts = {h: c // 2 for h, c in self._counts.items() if c > 1}
        counts = self._counts
        for block_hash in stride_hashes:
            counts[block_hash] = counts.get(block_hash, 0) + 1

    def count(self, stride_hash: int) -> int:
        """Recent requests through the prefix that ends at ``stride_hash``."""
        return self._counts.get(stride_hash, 0)

    def depth(self, stride_hashes: Sequence[int], threshold: int) -> int:
        """How many leading strides at least ``threshold`` recent requests shared."""
        low, high = 0, len(stride_hashes)  # the answer lies in [low, high]
        while low < high:
            middle = (low + high + 1) // 2
            if self._counts.get(stride_hashes[middle - 1], 0) >= threshold:
                low = middle
            else:
                high = middle - 1
        return low

    def __len__(self) -> int:
        return len(self._counts)


def _drop_holder(holders: dict[int, int], bit: int, block_hash: int) -> None:
    """Replica ``bit`` no longer holds ``block_hash``; a key nobody holds is forgotten."""
    mask = holders.get(block_hash, 0) & ~(1 << bit)
    if mask:
        holders[block_hash] = mask
    else:
        holders.pop(block_hash, None)


def _bits_of(mask: int) -> Iterator[int]:
    """The positions of the set bits of ``mask``, lowest first."""
    while mask:
        low = mask & -mask
        yield low.bit_length() - 1
        mask ^= low
