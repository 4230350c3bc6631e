"""Routing policies, chosen by name from a registry; one small module per family.

- ``base``: the ``Policy`` base (the types it reads: ``router/core.py``);
- ``config``: the knobs of every policy (each family's own settings kept with it);
- ``baselines``: round robin, random, least loaded, power of two, consistent hashing;
- ``indexed``: the base of cache-aware policies (a prefix index);
- ``cache_aware``: ours, precise and approximate;
- ``cache_aware_ttft``: ours priced in seconds to the first token, from a cost profile;
- ``replicated``: ours with a replication set per hot prefix;
- ``sglang``: SGLang router's ``cache_aware``, for comparison.
"""

from __future__ import annotations

import numpy as np

from router.core import Clock
from router.policies.base import Policy
from router.policies.baselines import (
    ConsistentHash,
    LeastLoaded,
    PowerOfTwo,
    Random,
    RoundRobin,
    rendezvous,
    rendezvous_key,
)
from router.policies.cache_aware import (
    CacheAware,
    CacheAwareAdapterBlind,
    CacheAwareApproximate,
    CacheAwareTierBlind,
)
from router.policies.cache_aware_ttft import CacheAwareTTFT
from router.policies.config import PolicyConfig
from router.policies.replicated import CacheAwareReplicated
from router.policies.sglang import SGLangCacheAware

__all__ = [
    "POLICIES",
    "Policy",
    "PolicyConfig",
    "make_policy",
    "rendezvous",
    "rendezvous_key",
]

POLICIES: dict[str, type[Policy]] = {
    cls.name: cls
    for cls in (
        RoundRobin,
        Random,
        LeastLoaded,
        PowerOfTwo,
        ConsistentHash,
        SGLangCacheAware,
        CacheAware,
        CacheAwareTierBlind,
        CacheAwareAdapterBlind,
        CacheAwareApproximate,
        CacheAwareTTFT,
        CacheAwareReplicated,
    )
}


def make_policy(
    name: str,
    clock: Clock,
    rng: np.random.Generator,
    config: PolicyConfig | None = None,
) -> Policy:
    try:
        cls = POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; known: {', '.join(POLICIES)}") from None
    return cls(config or PolicyConfig(), clock, rng)
