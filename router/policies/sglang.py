"""SGLang router's ``cache_aware``, re-implemented for comparison."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from router.core import ReplicaState, RoutingRequest
from router.index.prefix_index import IndexConfig
from router.policies.base import PolicyConfig
from router.policies.indexed import IndexedPolicy


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
        config = self.config
        if high - low > config.balance_abs_threshold and high > config.balance_rel_threshold * low:
            chosen = self._least_loaded(replicas)
        else:
            best = max(replicas, key=lambda r: matched.get(r.replica_id, 0))
            rate = matched.get(best.replica_id, 0) / request.num_prompt_tokens
            if rate > config.cache_threshold:
                chosen = best
            else:
                chosen = min(replicas, key=lambda r: self.index.num_entries(r.replica_id))
        request.predicted_cached_tokens = matched.get(chosen.replica_id, 0)
        return chosen

    def _index_capacity(self, replica: ReplicaState) -> int:
        return self.config.sglang_max_tree_tokens // self.config.block_size
