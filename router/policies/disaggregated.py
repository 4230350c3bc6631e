"""Prefill/decode disaggregation: a request's prompt prefilled on one replica, its KV
pulled by the replica that decodes it (replica/kv_transfer.py).

The policy's ``choose`` returns the decode replica, where the request's answer comes
from, and plans in ``request.kv`` the prefill replica, when it is another: the
gateway and the replayer run the two legs (vLLM's ``kv_transfer_params`` protocol).

- ``pd_blind``: the least-loaded prefill and decode replicas, as a plain P/D proxy
  picks them: the baseline that forgets the prefix cache.
- ``pd_always``: both chosen cache-aware (``cache_aware_ttft``'s seconds): the decode
  replica by its load and what it holds (a conversation's next turn finds its history
  where its last turn decoded), the prefill replica by its cached prefix and queue.
- ``pd_conditional``: as ``pd_always``, but a request is prefilled in place on its
  decode replica when few of its tokens are uncached there, or when the predicted
  seconds say so (see :class:`PDConditional`).
"""

from __future__ import annotations

from collections.abc import Sequence

from router.core import KVPlan, ReplicaState, RoutingRequest, can_decode, can_prefill
from router.policies.base import Policy
from router.policies.cache_aware_ttft import CacheAwareTTFT


def _pools(replicas: Sequence[ReplicaState]) -> tuple[list[ReplicaState], list[ReplicaState]]:
    """The replicas that may prefill and those that may decode (all, if none may)."""
    prefill = [r for r in replicas if can_prefill(r)] or list(replicas)
    decode = [r for r in replicas if can_decode(r)] or list(replicas)
    return prefill, decode


def _plan(request: RoutingRequest, prefill: ReplicaState, decode: ReplicaState) -> None:
    request.kv = KVPlan(prefill=prefill) if prefill is not decode else None


class PDBlind(Policy):
    """The least-loaded prefill replica and the least-loaded decode replica, always
    disaggregated (one replica that does both: in place)."""

    name = "pd_blind"
    disaggregates = True

    def choose(self, request: RoutingRequest, replicas: Sequence[ReplicaState]) -> ReplicaState:
        prefill, decode = _pools(replicas)
        chosen = self._least_loaded(decode)
        _plan(request, self._least_loaded(prefill), chosen)
        return chosen


class PDAlways(CacheAwareTTFT):
    """Cache-aware prefill and decode replicas, always disaggregated."""

    name = "pd_always"
    disaggregates = True

    def choose(self, request: RoutingRequest, replicas: Sequence[ReplicaState]) -> ReplicaState:
        prefill_pool, decode_pool = _pools(replicas)
        decode = super().choose(request, decode_pool)
        pull = request.kv  # a peer pull planned for an in-place prefill (--peer-pulls)
        held = request.predicted_cached_tokens or 0
        prefill = super().choose(request, prefill_pool)  # predicts the prefill's hits
        if self._in_place(request, prefill, decode, held):
            request.kv, request.predicted_cached_tokens = pull, held
            return decode
        _plan(request, prefill, decode)
        return decode

    def _in_place(
        self, request: RoutingRequest, prefill: ReplicaState, decode: ReplicaState, held: int
    ) -> bool:
        return prefill is decode


class PDConditional(PDAlways):
    """``pd_always``, prefilling in place what is cheaper in place.

    A request with at most ``local_prefill_tokens`` uncached on its decode replica is
    prefilled there (a conversation's next turn, mostly). Otherwise the two ways are
    priced in predicted seconds:

        in place      = first token on the decode replica (its queue, the prefill)
                      + the prefill again for each request running there (their stall)
        disaggregated = first token on the prefill replica
                      + the pull of the KV the decode replica lacks
                      + its own step, computing the last partial block

    and the cheaper wins. The stall is what disaggregation exists for: every decode
    batched with a long prefill waits for it, a gap in its stream of tokens. On a
    decode replica with nothing running, a long prompt stalls nobody and is prefilled
    in place if that is sooner; under load, every long one goes to a prefill replica
    unless the prefill pool's queue outweighs the stalls.
    """

    name = "pd_conditional"

    def _in_place(
        self, request: RoutingRequest, prefill: ReplicaState, decode: ReplicaState, held: int
    ) -> bool:
        prompt = request.num_prompt_tokens
        if prefill is decode or prompt - held <= self.config.kv.local_prefill_tokens:
            return True
        stall = self._prefill_s(held, prompt - held) * decode.load_requests
        in_place = self.first_token_s(decode, held, prompt - held) + stall
        prefilled = request.predicted_cached_tokens or 0
        full = self._limit(request)
        disaggregated = (
            self.first_token_s(prefill, prefilled, prompt - prefilled)
            + self.moves.pull_s(max(full - held, 0))
            + self.first_token_s(decode, full, prompt - full)
        )
        return in_place <= disaggregated
