"""SGLang router's ``cache_aware``, re-implemented for comparison."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from router.core import ReplicaState, RoutingRequest
from router.index.prefix_index import IndexConfig
from router.policies.indexed import IndexedPolicy

if TYPE_CHECKING:
    from router.policies.registry import PolicyConfig


@dataclass(frozen=True)
class SGLangConfig:
    """``sglang_cache_aware``'s knobs: SGLang router's defaults."""

    cache_threshold: float = 0.3
    balance_abs_threshold: int = 64
    balance_rel_threshold: float = 1.5
    #: SGLang's tree holds up to 2**26 characters per worker (about 4 per token).
    sglang_max_tree_tokens: int = 2**26 // 4

    def __post_init__(self) -> None:
        if not 0 <= self.cache_threshold <= 1:
            raise ValueError("cache_threshold must lie in [0, 1]")


class SGLangCacheAware(IndexedPolicy):
    """SGLang router's ``cache_aware``, re-implemented from its documented algorithm.

    1. If the fleet is imbalanced, (max - min) > balance_abs_threshold and
       max > balance_rel_threshold x min in outstanding requests, go to the least
       loaded worker.
    2. Else find the worker whose approximate tree matches the longest prefix; if the
       match rate (matched / prompt tokens) exceeds cache_threshold, go there.
    3. Else go to the worker with the smallest tree (the most free cache, it assumes).
    Every decision inserts the prompt into the chosen worker's tree; the tree learns
    only from routing and holds up to 2**26 characters per worker, so it rarely
    forgets what a worker has long evicted.
    """

    name = "sglang_cache_aware"

    def _index_config(self, config: PolicyConfig) -> IndexConfig:
        return replace(config.index, mode="approximate", ttl_s=float("inf"))

    def choose(self, request: RoutingRequest, replicas: Sequence[ReplicaState]) -> ReplicaState:
        matched = self._matches(request, replicas)
        loads = [r.outstanding_requests for r in replicas]
        high, low = max(loads), min(loads)
        knobs = self.config.sglang
        if high - low > knobs.balance_abs_threshold and high > knobs.balance_rel_threshold * low:
            chosen = self._least_loaded(replicas)
        else:
            best = max(replicas, key=lambda r: matched.get(r.replica_id, 0))
            rate = matched.get(best.replica_id, 0) / request.num_prompt_tokens
            if rate > knobs.cache_threshold:
                chosen = best
            else:
                chosen = min(replicas, key=lambda r: self.index.num_entries(r.replica_id))
        request.predicted_cached_tokens = matched.get(chosen.replica_id, 0)
        return chosen

    def _index_capacity(self, replica: ReplicaState) -> int:
        return self.config.sglang.sglang_max_tree_tokens // self.config.block_size
