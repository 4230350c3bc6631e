"""Several models in one fleet: which replicas serve which model, one policy per model.

A request names a model, or a LoRA adapter of one (vLLM's way: the adapter's name is
the request's ``model``). It may go only to a replica that serves that model, so the
router routes by model before it routes by prefix, as vLLM's router, SGLang's gateway
and llm-d do. Each base model has a policy of its own over the replicas serving it:
its own index (identities are seeded by the model's or the adapter's name, so two
models never share one), its own load order and its own fleet mean. Adapters live in
their base model's policy, which weighs where an adapter is already loaded.

A replica says what it serves in its card (``ReplicaState.model`` and ``adapters``);
one that has not said (a server that describes itself to nobody) serves the
gateway's default model, as every replica did before fleets had several.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from replica.api.kv_events import KVEvent
from router.core import ReplicaState
from router.policies import Policy


@dataclass(frozen=True)
class ServedName:
    """What a request's ``model`` names: a base model, and the adapter on it if any."""

    model: str
    adapter: str | None = None

    @property
    def name(self) -> str:
        """The name its block identities are seeded with."""
        return self.adapter or self.model


class ModelRoutes:
    """One policy per base model; ``make_policy(model)`` builds one for a model."""

    def __init__(self, make_policy: Callable[[str], Policy], default_model: str) -> None:
        self._make_policy = make_policy
        self.default_model = default_model
        self.policies: dict[str, Policy] = {}
        self._members: dict[str, dict[str, ReplicaState]] = {}  # model -> replica id -> state

    def model_of(self, replica: ReplicaState) -> str:
        return replica.model or self.default_model

    def policy(self, model: str | None = None) -> Policy:
        """The policy routing ``model`` (the default model's by default)."""
        model = model or self.default_model
        policy = self.policies.get(model)
        if policy is None:
            policy = self.policies[model] = self._make_policy(model)
        return policy

    # ------------------------------------------------------------- replicas

    def added(self, replica: ReplicaState) -> None:
        model = self.model_of(replica)
        self._members.setdefault(model, {})[replica.replica_id] = replica
        self.policy(model).on_replica_added(replica)

    def removed(self, replica: ReplicaState) -> None:
        model = self.model_of(replica)
        members = self._members.get(model, {})
        if members.pop(replica.replica_id, None) is not None:
            self.policy(model).on_replica_removed(replica)

    def events(self, replica: ReplicaState, events: Sequence[KVEvent]) -> int:
        return self.policy(self.model_of(replica)).on_kv_events(replica, events)

    def switch(self, make_policy: Callable[[str], Policy]) -> None:
        """Route with new policies from now on; they learn the fleet afresh."""
        self._make_policy = make_policy
        self.policies = {}
        for model, members in self._members.items():
            policy = self.policy(model)
            for replica in members.values():
                policy.on_replica_added(replica)

    # ------------------------------------------------------------- requests

    def resolve(self, name: str | None) -> ServedName | None:
        """What ``name`` names (none: the default model), or ``None`` if no replica
        serves it."""
        if not name:
            return ServedName(self._default())
        if self._members.get(name) or (name == self.default_model and not self._served()):
            return ServedName(name)
        for model, members in self._members.items():
            if any(name in replica.adapters for replica in members.values()):
                return ServedName(model, name)
        return None

    def serving(self, served: ServedName, replicas: Iterable[ReplicaState]) -> list[ReplicaState]:
        """Those of ``replicas`` that can serve a request for ``served``."""
        model, adapter = served.model, served.adapter
        return [
            r
            for r in replicas
            if self.model_of(r) == model and (adapter is None or adapter in r.adapters)
        ]

    def names(self) -> list[tuple[str, str | None]]:
        """Every model and adapter the fleet serves, with each adapter's base model."""
        default = self._default()
        listed: list[tuple[str, str | None]] = [(default, None)]
        listed += [(model, None) for model in self._served() if model != default]
        adapters = {
            (adapter, model)
            for model, members in self._members.items()
            for replica in members.values()
            for adapter in replica.adapters
        }
        return listed + sorted(adapters)

    def replicas(self, model: str) -> list[ReplicaState]:
        return list(self._members.get(model, {}).values())

    def _served(self) -> list[str]:
        return [model for model, members in self._members.items() if members]

    def _default(self) -> str:
        """The model of a request that names none: the gateway's, unless no replica
        serves it and another model is served."""
        served = self._served()
        return self.default_model if self.default_model in served or not served else served[0]
