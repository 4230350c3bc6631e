"""Routing policies, chosen by name from a registry; one small module per family.

- ``base``: the ``Policy`` base (the types it reads: ``router/core.py``);
- ``registry``: every policy by name, and ``PolicyConfig``: the knobs they share and
  each family's settings (kept with the family);
- ``baselines``: round robin, random, least loaded, power of two, consistent hashing;
- ``indexed``: the base of cache-aware policies (a prefix index);
- ``cache_aware``: ours, precise and approximate;
- ``cache_aware_ttft``: ours priced in seconds to the first token, from a cost profile;
- ``replicated``: ours with a replication set per hot prefix;
- ``sglang``: SGLang router's ``cache_aware``, for comparison.
"""

from __future__ import annotations

from router.policies.base import Policy
from router.policies.baselines import rendezvous, rendezvous_key
from router.policies.registry import POLICIES, PolicyConfig, make_policy

__all__ = [
    "POLICIES",
    "Policy",
    "PolicyConfig",
    "make_policy",
    "rendezvous",
    "rendezvous_key",
]
