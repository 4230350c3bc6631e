"""Every policy by name, and the knobs of every policy: what they share, and each
family's own settings, kept with the family (``CacheAwareConfig`` in
``cache_aware.py``, ...). A new policy is its module, its line in ``POLICIES`` and,
if it has settings, its field in ``PolicyConfig``.

The gateway (``GatewayConfig.routing``) and the replayer (``ReplayConfig.routing``)
embed one and the same ``PolicyConfig``, so the bench replays a live run with exactly
the knobs the gateway routed with. The command line flattens it: every field is one
flag of its own name (``--stride``, ``--recompute-weight``, ``--cache-threshold``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from replica.api.identity import DEFAULT_BLOCK_SIZE, DEFAULT_MODEL
from router.core import Clock
from router.index.prefix_index import IndexConfig
from router.policies.base import Policy
from router.policies.baselines import ConsistentHash, LeastLoaded, PowerOfTwo, Random, RoundRobin
from router.policies.cache_aware import (
    CacheAware,
    CacheAwareAdapterBlind,
    CacheAwareApproximate,
    CacheAwareConfig,
    CacheAwareTierBlind,
)
from router.policies.cache_aware_ttft import CacheAwareTTFT, TTFTConfig
from router.policies.disaggregated import PDAlways, PDBlind, PDConditional
from router.policies.kv_moves import KVConfig
from router.policies.replicated import CacheAwareReplicated, ReplicationConfig
from router.policies.sglang import SGLangCacheAware, SGLangConfig

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
        PDBlind,
        PDAlways,
        PDConditional,
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


@dataclass(frozen=True)
class PolicyConfig:
    """What every policy reads (the blocks, the model, the index), and each family's
    own settings; a policy reads the ones it needs."""

    #: Tokens per KV block of the fleet's engines (the router must hash as they do).
    block_size: int = DEFAULT_BLOCK_SIZE
    #: The model the fleet serves: it seeds the router's keys, as it seeds the engines'
    #: identities. Set by the config that embeds this one (the gateway's, the replay's).
    model: str = field(default=DEFAULT_MODEL, metadata={"flag": False})
    index: IndexConfig = field(default_factory=IndexConfig)
    cache_aware: CacheAwareConfig = field(default_factory=CacheAwareConfig)
    replication: ReplicationConfig = field(default_factory=ReplicationConfig)
    ttft: TTFTConfig = field(default_factory=TTFTConfig)
    sglang: SGLangConfig = field(default_factory=SGLangConfig)
    kv: KVConfig = field(default_factory=KVConfig)

    @classmethod
    def of(cls, **knobs: Any) -> PolicyConfig:
        """The config with ``knobs`` set by their own names, as their flags set them
        (``PolicyConfig.of(stride=8, recompute_weight=2.0)``)."""
        return _with_knobs(cls(), knobs)

    def for_engines(self, profile: str, step_token_budget: int) -> PolicyConfig:
        """These knobs with the seconds priced as the fleet's engines run, unless set."""
        ttft = self.ttft
        return replace(
            self,
            ttft=replace(
                ttft,
                cost_profile=ttft.cost_profile or profile,
                step_token_budget=ttft.step_token_budget or step_token_budget,
            ),
        )

    @property
    def stride_tokens(self) -> int:
        """Tokens between two hashed block boundaries (the router's unit of prefix)."""
        return self.block_size * self.index.stride

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be positive, got {self.block_size}")


def _with_knobs(config: Any, knobs: dict[str, Any]) -> Any:
    """``config`` with each of ``knobs`` set wherever a field of its name lies (the
    knobs it has no field for are refused)."""
    changes, left = {}, dict(knobs)
    for spec in dataclasses.fields(config):
        value = getattr(config, spec.name)
        if dataclasses.is_dataclass(value):
            inner = {n: left.pop(n) for n in list(left) if _has_field(value, n)}
            if inner:
                changes[spec.name] = _with_knobs(value, inner)
        elif spec.name in left:
            changes[spec.name] = left.pop(spec.name)
    if left:
        raise TypeError(f"no knob named {', '.join(left)}")
    return replace(config, **changes)


def _has_field(config: Any, name: str) -> bool:
    return any(
        spec.name == name
        or (
            dataclasses.is_dataclass(getattr(config, spec.name))
            and _has_field(getattr(config, spec.name), name)
        )
        for spec in dataclasses.fields(config)
    )
