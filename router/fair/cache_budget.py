"""Tenant cache budgets: where a tenant's new prefix may be computed.

A tenant with a budget (a key's ``budget=F``) should hold at most the fraction F of
any replica's GPU blocks, so that one tenant's many long prompts (a flood, a RAG
corpus) cannot evict every other tenant's prefixes fleet-wide. The engine's LRU evicts
and the router cannot; what the router chooses is where a tenant's prefix is
computed, and every block a replica computes evicts another. So a request from a
tenant is steered:

- to the replicas where the tenant is below its budget, if a candidate is;
- at its budget everywhere, to the one where it holds the most, so that its new blocks
  evict mostly its own old ones and the other replicas keep other tenants';
- and, besides these, to any replica holding more of its prompt than they do and more
  than its popular prefix: a conversation stays where its history is (a hit adds only
  the prompt's tail), while a new one, which shares only a system prompt with others,
  is computed where steered.

The policy still chooses among what is left, by its own costs. A tenant's blocks per
replica are those the precise index counts from the replicas' events under the
tenant's cache salts (``router/index/event_keys.py``); a replica known from decisions alone,
or of unknown capacity, is never excluded. The budget is soft: the count trails the
events, and a hit on an over-budget replica is allowed.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from router.core import ReplicaState, RoutingRequest
from router.policies import Policy


def within_budget(
    policy: Policy,
    request: RoutingRequest,
    candidates: Sequence[ReplicaState],
    salts: Collection[str | None],
) -> Sequence[ReplicaState]:
    """The candidates a request of a tenant with ``request.cache_budget`` may go to;
    ``salts``: the tenant's cache salts (its blocks are counted under them)."""
    budget, index = request.cache_budget, policy.prefix_index()
    if budget is None or index is None or len(candidates) < 2:
        return candidates
    held = {r.replica_id: index.gpu_blocks_of(r.replica_id, salts) for r in candidates}
    over = {  # a replica not known from its events holds nothing counted: never over
        r.replica_id
        for r in candidates
        if r.capacity_blocks > 0 and held[r.replica_id] >= budget * r.capacity_blocks
    }
    if not over:
        return candidates
    targets = {r.replica_id for r in candidates if r.replica_id not in over}
    if not targets:  # at its budget everywhere: where it holds the most
        most = max(held.values())
        targets = {replica_id for replica_id, blocks in held.items() if blocks == most}
    matched = index.match(request.stride_hashes)
    # what a target holds, or every replica may (a popular system prompt)
    floor = max(policy.popular_tokens(request), *(matched.get(r, 0) for r in targets))
    return [
        r for r in candidates if r.replica_id in targets or matched.get(r.replica_id, 0) > floor
    ]
