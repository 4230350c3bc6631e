"""The types every room of the router shares: a replica as the router knows it, a
request as it is routed, and the clock that is passed in.

They sit at the bottom of ``router/``: the policies read them, the fleet keeps a
``ReplicaState`` per backend, the request path carries a ``RoutingRequest`` from its
envelope to its settlement, and the replayer builds both in virtual time.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from replica.api.stats import LoadReport

Clock = Callable[[], float]


class KVStream(Protocol):
    """A replica's KV event stream as the gateway follows it, with a replay socket
    (``router/index/kv_subscriber.py``): what a policy may ask of it."""

    @property
    def indexed_through(self) -> int | None:
        """The number of the batch after the last one in the index (``None``: none yet)."""
        ...

    def replay_since(self, batch: int) -> None:
        """Apply its batches from ``batch`` on again, from the replay buffer (one the
        buffer no longer holds: the replica's entries start over)."""
        ...


@dataclass(eq=False)
class ReplicaState:
    """What the router knows of one replica.

    ``outstanding_requests`` and ``outstanding_prefill_tokens`` are this router's own:
    its requests in flight there, and the tokens they still have to prefill (their
    predicted uncached part) until their first token arrives. Policies balance on
    ``load_requests`` and ``load_prefill_tokens``: the replica's own last report, which
    counts every gateway's requests, plus this router's requests dispatched since;
    without reports (the replayer, a foreign engine), the router's own counts.
    """

    replica_id: str
    capacity_blocks: int = 0
    #: Whether its KV events key to the router's identities (see router/fleet/backend_check.py):
    #: if not, cache-aware policies know it from their decisions alone.
    precise: bool = True
    outstanding_requests: int = 0
    outstanding_prefill_tokens: int = 0
    #: This router's requests there that have not had their first token yet.
    outstanding_prefills: int = 0
    dispatched: int = 0
    report: LoadReport | None = None
    #: This router's requests in flight there, by id, and those dispatched after the report.
    in_flight: dict[str, RoutingRequest] = field(default_factory=dict, repr=False)
    requests_since_report: int = 0
    prefill_tokens_since_report: int = 0
    #: KV blocks it could give a new request now, as it last said (``None``: not known,
    #: as for an engine that does not report its load).
    free_blocks: int | None = None
    #: Requests waiting in its engine's own queue, not running yet, as it last said
    #: (``None``: not said), and the most its engine runs at once, as its card says
    #: (vLLM's ``max_num_seqs``; ``None``: not said). Admission reads both
    #: (router/fair/slots.py).
    engine_waiting: int | None = None
    max_num_seqs: int | None = None
    #: The model it serves and the LoRA adapters on it, as it says of itself (``None``:
    #: not said; see router/fleet/models.py).
    model: str | None = None
    adapters: frozenset[str] = frozenset()
    #: What it does in a disaggregated fleet: ``both``, ``prefill`` or ``decode``.
    role: str = "both"
    #: The adapters in its GPU slots, and how many slots another could take now, as it
    #: last said (``None``: not said).
    loaded_adapters: tuple[str, ...] | None = None
    free_adapter_slots: int | None = None
    #: Told after every change of the load above (``router/fleet/load.py`` calls it): the
    #: policy's ordering of the fleet by load.
    on_load_change: Callable[[ReplicaState], None] | None = field(default=None, repr=False)
    #: Its KV event stream, set by the fleet that follows it with a replay socket
    #: (``None``: none such, as in the replayer or for an engine without replay).
    kv_stream: KVStream | None = field(default=None, repr=False)
    #: Answers that found fewer cached tokens than predicted: where its KV events alone had
    #: said more (the index and the engine disagree: router/policies/indexed.py), and where
    #: they had not (the router's own decisions said more, or the engine told of an
    #: eviction after the dispatch).
    event_disagreements: int = 0
    decision_corrections: int = 0

    @property
    def load_requests(self) -> int:
        if self.report is None:
            return self.outstanding_requests
        return self.report.running + self.report.waiting + self.requests_since_report

    @property
    def load_waiting(self) -> int:
        """Requests queued there, not running yet: the engine's waiting queue where it
        reports it (and this router's requests sent since), else this router's requests
        before their first token but the one in its prefill (the same figure once the
        engine is saturated: a request admitted to the batch has its first token a
        step later)."""
        if self.report is None:
            return max(0, self.outstanding_prefills - 1)
        return self.report.waiting + self.requests_since_report

    @property
    def load_prefill_tokens(self) -> int:
        if self.report is None:
            return self.outstanding_prefill_tokens
        return self.report.prefill_tokens + self.prefill_tokens_since_report


#: Why an engine finds fewer cached tokens than the router predicted. ``pending``: its
#: KV events at the dispatch said no more than it found, the rest was the router's own
#: decisions (requests sent there whose blocks it had not stored yet); ``evicted``: its
#: events told of an eviction of the prompt while the request waited there; ``unexplained``:
#: its events said it held more and told of no eviction (withheld or lost).
OVER_CAUSES = ("pending", "evicted", "unexplained")


@dataclass(eq=False)
class RoutingRequest:
    """A request as the router sees it: its length and its leading block identities.

    ``stride_hashes`` are the identities at every ``stride``-th block boundary.
    ``predicted_cached_tokens`` is set by a cache-aware policy's ``choose``.
    """

    request_id: str
    num_prompt_tokens: int
    stride_hashes: Sequence[int] = field(default=(), repr=False)
    predicted_cached_tokens: int | None = None
    #: Who sent it (``None`` without API keys); its identities are seeded per tenant.
    tenant: str | None = None
    #: Dispatched and its prefill not yet done: its uncached tokens load the replica.
    prefilling: bool = field(default=False, repr=False)
    #: When it was dispatched (wall clock, to compare with the replica's load reports).
    dispatched_at: float = field(default=0.0, repr=False)
    #: The client's session key (``None``: it sent none): its turns belong together.
    session: str | None = None
    #: The model it names (``None``: the default) and the LoRA adapter it runs under.
    model: str | None = None
    adapter: str | None = None
    #: Its request class's rank (0: interactive, 1: batch; router/fair/fairness.py) and its
    #: tenant's weight: what orders it in the gateway's queue when replicas are full.
    priority: int = 0
    weight: float = 1.0
    #: Its tenant's cache budget, a fraction of each replica's GPU blocks (``None``:
    #: none): where its new prefix may be computed (router/fair/cache_budget.py).
    cache_budget: float | None = None
    #: The identity of its first stride of blocks (``replica.api.identity.affinity_key``):
    #: what rendezvous hashing spreads it by when it is cached nowhere.
    affinity: int | None = field(default=None, repr=False)
    #: How its KV reaches the replica chosen for it when not computed there, as the
    #: policy planned it (``None``: computed where it runs).
    kv: KVPlan | None = None
    #: When it was sent: the leading tokens its replica's KV events alone said it held
    #: (``None``: that replica is not known from its events), and the batch of its stream
    #: after the last one in the index then (``None``: no stream). An engine that finds
    #: fewer is out of step with its events from before that batch.
    events_cached_tokens: int | None = field(default=None, repr=False)
    events_batch: int | None = field(default=None, repr=False)
    #: Why its engine found fewer cached tokens than predicted, once it ended (``None``:
    #: it did not): one of :data:`OVER_CAUSES`.
    over_cause: str | None = field(default=None, repr=False)

    @property
    def predicted_uncached_tokens(self) -> int:
        return self.num_prompt_tokens - (self.predicted_cached_tokens or 0)


@dataclass(frozen=True, eq=False)
class KVPlan:
    """How a request's KV reaches the replica that decodes it: its prompt prefilled on
    ``prefill`` and pulled from there (disaggregated), or its leading ``pull_tokens``
    pulled from ``pull_from``, a peer that holds them, and the rest computed."""

    prefill: ReplicaState | None = None
    pull_from: ReplicaState | None = None
    pull_tokens: int = 0

    @property
    def path(self) -> str:
        """``disaggregated`` or ``pulled``."""
        return "disaggregated" if self.prefill is not None else "pulled"


def can_prefill(replica: ReplicaState) -> bool:
    return replica.role != "decode"


def can_decode(replica: ReplicaState) -> bool:
    return replica.role != "prefill"
