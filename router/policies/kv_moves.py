"""KV that moves, priced: when a replica should pull a prefix from a peer rather than
compute it, and the knobs of KV movement (peer pulls, conditional disaggregation).

A pull's price is the engines' own (replica/kv_transfer.py times it the same way): the
prefix's bytes over the peer link, per GPU, plus the link's fixed cost per pull; what
it saves is the prefill of those tokens as the cost profile times it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from replica.api.config import DEFAULT_PROFILE
from replica.api.cost_model import CostProfile, HostLink, get_peer_link, get_profile
from router.core import KVPlan, ReplicaState, RoutingRequest


@dataclass(frozen=True)
class KVConfig:
    """How KV may move between replicas: pulled from a peer, or prefilled elsewhere."""

    #: The link between replicas, as the engines' (``--peer-link``): nvlink, rdma200,
    #: rdma400, tcp or GB/s.
    peer_link: str = "rdma200"
    #: Whether cache-aware policies weigh pulling the prefix a peer holds (the pull's
    #: seconds) against going where it is cached or computing it, and have the replica
    #: they choose pull it where that beats computing it.
    peer_pulls: bool = False
    #: Conditional disaggregation prefills a request in place on its decode replica
    #: when at most this many of its tokens are uncached there (vLLM's P/D design: 256).
    local_prefill_tokens: int = 256

    def __post_init__(self) -> None:
        get_peer_link(self.peer_link)
        if self.local_prefill_tokens < 0:
            raise ValueError(
                f"local_prefill_tokens must not be negative, got {self.local_prefill_tokens}"
            )


class KVMoves:
    """Seconds to have a request's prefix each way: computed there, or pulled."""

    def __init__(self, config: KVConfig, cost_profile: str = "") -> None:
        self.config = config
        self.profile: CostProfile = get_profile(cost_profile or DEFAULT_PROFILE)
        self.link: HostLink = get_peer_link(config.peer_link)

    def pull_s(self, tokens: int) -> float:
        return self.profile.transfer_time(tokens, self.link)

    def pull_beats_compute(self, held: int, pullable: int, prompt: int) -> bool:
        """Whether pulling tokens ``held`` to ``pullable`` of a ``prompt`` costs less
        than computing them in the prefill that computes the rest anyway."""
        prefill = self.profile.prefill_time
        saved = prefill(held, prompt - held) - prefill(pullable, prompt - pullable)
        return self.pull_s(pullable - held) < saved

    def plan_pull(
        self,
        request: RoutingRequest,
        chosen: ReplicaState,
        matched: Mapping[str, int],
        states: Mapping[str, ReplicaState],
    ) -> None:
        """Have ``chosen`` pull the longest prefix a peer holds beyond its own (by
        ``matched``, tokens held per replica id), if the pull beats computing it; it
        sets ``request.kv`` and the tokens predicted cached."""
        held = matched.get(chosen.replica_id, 0)
        peers = [(tokens, rid) for rid, tokens in matched.items() if rid in states]
        if not peers:
            return
        pullable, holder = max(peers)
        if pullable <= held or holder == chosen.replica_id:
            return
        if self.pull_beats_compute(held, pullable, request.num_prompt_tokens):
            request.kv = KVPlan(pull_from=states[holder], pull_tokens=pullable)
            request.predicted_cached_tokens = pullable
